"""Plan: how the work of training is split over processes.

A Plan is one value that names every parallel degree and the memory/precision options.
`str(plan)` and `Plan.parse(text)` round-trip, so a plan can travel through the CLI,
logs and checkpoints.

What belongs in the Plan and what is an argument of `parallelize` (the rule): the Plan
holds how the work is split over processes and devices and what that split may trade
(degrees, micro-batches, schedule, recomputation, offload, resharding, precision); it
is what a planner may choose, and one Plan fits any model. Arguments hold what belongs
to the user's model and code (loss, optimizer, clipping, LR schedule, overrides that name
the model's parts: tp_plan, pp_split, example_inputs) and opt-in tooling that changes
neither the split nor the numbers (compile).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from meshfit.errors import MeshfitError


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule, as everything that reads one needs it: torch's class (in
    torch.distributed.pipelining; the runtime builds it, parallel/pipeline/schedule.py),
    the stages each pipeline rank runs ("virtual" stages of the interleaved ones), the
    share of the (pp - 1) x micro-batch bubble it leaves (the planner's time), the
    micro-batches in flight on a rank (the planner's memory), and its rule for the number
    of micro-batches (Plan.validate)."""

    name: str
    torch_class: str
    virtual_stages: int
    # micro-batches must be at least pp ("at_least") or a multiple of pp ("multiple");
    # None: any number
    microbatch_rule: str | None
    bubble_share: float  # of (pp - 1) micro-batch times; 1/virtual for interleaved 1F1B

    def in_flight(self, microbatches: int, pp: int, rank: int) -> float:
        """Micro-batches whose activations pipeline rank `rank` holds at its peak."""
        if self.name == "gpipe":
            return float(microbatches)
        if self.virtual_stages == 1:
            return float(min(microbatches, pp - rank))
        # interleaved: (v - 1) pp + 2 (pp - 1 - rank) + 1 chunk micro-batches in warm-up,
        # each a 1/v share of the rank's blocks
        v = self.virtual_stages
        warmup = (v - 1) * pp + 2 * (pp - 1 - rank) + 1
        return min(float(microbatches), warmup / v)


SCHEDULE_TABLE = {
    s.name: s
    for s in (
        Schedule("gpipe", "ScheduleGPipe", 1, None, 1.0),
        Schedule("1f1b", "Schedule1F1B", 1, "at_least", 1.0),
        Schedule("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "multiple", 1 / 2),
        Schedule("zero-bubble", "ScheduleInterleavedZeroBubble", 2, "multiple", 1 / 3),
    )
}
SCHEDULES = tuple(SCHEDULE_TABLE)
# stages per pipeline rank each schedule runs (the interleaved ones: two, "virtual")
VIRTUAL_STAGES = {name: s.virtual_stages for name, s in SCHEDULE_TABLE.items()}
CHECKPOINTING = ("none", "full", "selective")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")

# The parallel degrees a Plan holds. Their order on the device mesh, their roles and
# which groups they make are the Topology's (topology.DIMS), which alone knows them.
DEGREES = ("dp", "fsdp", "cp", "tp", "pp")

BOOLEAN_FIELDS = ("offload", "reshard_after_forward")


@dataclass(frozen=True)
class Plan:
    """How to split training over `dp * fsdp * cp * tp * pp` processes.

    dp: data-parallel replicas (DistributedDataParallel). ``None`` means "all the
        processes the other degrees leave", resolved against the world size.
    fsdp: sharded data parallel degree (FSDP2).
    cp: context parallel degree: each sequence of a rank's share is cut over cp ranks
        (each holds 1/cp of its tokens: two chunks, one early and one late, so causal
        attention costs every rank the same); attention gathers the keys and values of
        the cp group. Gradients are averaged over dp x fsdp x cp; FSDP2 shards over
        fsdp x cp.
    ep: expert parallel degree: every mixture-of-experts layer's experts spread whole over
        ep ranks, tokens sent to them (all-to-all). ep borrows its ranks from dp x fsdp
        x cp (it does not multiply the processes) and must divide that number.
    tp: tensor-parallel degree.
    pp: pipeline-parallel stages.
    microbatches: how many micro-batches each rank's share of the global batch is cut
        into. Without pipelining this is gradient accumulation; ``None`` means 1
        (or 2*pp with pipelining).
    schedule: pipeline schedule, one of SCHEDULES.
    checkpointing: activation recomputation, one of CHECKPOINTING.
    offload: keep parameters, gradients and optimizer state in CPU memory between uses
        (FSDP2's CPU offload; the optimizer step runs on the CPU), in one process too.
    reshard_after_forward: with FSDP, free each block's gathered parameters after its
        forward (ZeRO-3, the default; but the last block's and the root's, whose
        backward follows at once) or keep them until its backward (False: ZeRO-2-like,
        one all-gather fewer per block and step, more memory).
    precision: "fp32", "bf16" (autocast, fp32 master weights), "fp16" (autocast plus
        a gradient scaler) or "fp8" (bf16 with the Linear layers of the repeated blocks
        in float8 through torchao: an H100 / Ada GPU and pip install 'meshfit[fp8]').
    """

    dp: int | None = None
    fsdp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int | None = None
    schedule: str = "1f1b"
    checkpointing: str = "none"
    offload: bool = False
    precision: str = "fp32"
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("fsdp", "cp", "ep", "tp", "pp"):
            _check_positive_int(name, getattr(self, name))
        if self.dp is not None:
            _check_positive_int("dp", self.dp)
        if self.microbatches is not None:
            _check_positive_int("microbatches", self.microbatches)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _check_choice("precision", self.precision, PRECISIONS)
        for name in BOOLEAN_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise MeshfitError(
                    f"Plan {name} must be True or False, not {getattr(self, name)!r}"
                )

    # ---- sizes -------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int | None]:
        """The degree of every parallel dimension, by name (dp None until resolved)."""
        return {name: getattr(self, name) for name in DEGREES}

    @property
    def world_size(self) -> int | None:
        """Processes this plan needs, or None while dp is unresolved."""
        if self.dp is None:
            return None
        return self.dp * self.processes_per_replica

    @property
    def processes_per_replica(self) -> int:
        """Processes one dp replica spans: fsdp x cp x tp x pp (its shards, its sequence
        chunks, tensor-parallel ranks and pipeline stages)."""
        return self.fsdp * self.cp * self.tp * self.pp

    @property
    def replica_degrees(self) -> str:
        """The degrees one dp replica spans, as text: "fsdp*tp*pp" (and cp where set)."""
        return "fsdp*cp*tp*pp" if self.cp > 1 else "fsdp*tp*pp"

    @property
    def num_microbatches(self) -> int:
        if self.microbatches is not None:
            return self.microbatches
        return 2 * self.pp if self.pp > 1 else 1

    @property
    def defers_stage_reduction(self) -> bool:
        """pp x FSDP with several micro-batches: torch's schedule keeps each stage
        gathered, with its unsharded gradients, and reduce-scatters once at the step's
        end (less traffic, more memory). With one micro-batch nothing is saved by
        waiting: each block reduces and frees after its own backward (parallel/fsdp.py)."""
        return self.pp > 1 and self.uses_fsdp and self.num_microbatches > 1

    @property
    def leaves_pipeline_open(self) -> bool:
        """A pipeline plan that sets neither micro-batches nor schedule: meshfit may
        choose them for the model (one micro-batch under GPipe for BatchNorm,
        prepare.one_microbatch_for_batchnorm)."""
        return self.pp > 1 and self.microbatches is None and self.schedule == "1f1b"

    @property
    def data_parallel_size(self) -> int:
        """How many ways the global batch is split (replicated and sharded data parallel)."""
        if self.dp is None:
            raise MeshfitError("call Plan.resolve(world_size) before asking for sizes")
        return self.dp * self.fsdp

    @property
    def uses_fsdp(self) -> bool:
        """Whether data parallelism runs on FSDP2 rather than DDP: always for fsdp > 1,
        and for dp replicas too where DDP cannot serve them — tensor-parallel (DTensor)
        parameters, or offload (FSDP2's). FSDP2 replicates over "dp" (HSDP) and shards
        over "fsdp", so the numbers are those of the plan as written."""
        return self.fsdp > 1 or self.offload or (self.dp or 1) * self.cp > 1 and self.tp > 1

    def resolve(self, world_size: int) -> Plan:
        """Fill in ``dp=None`` from the world size and check the plan fits it."""
        others = self.processes_per_replica
        if self.dp is None:
            if world_size % others:
                raise MeshfitError(
                    f"plan {self} needs a multiple of {self.replica_degrees} = {others} processes, but "
                    f"{world_size} were started; start {_nearest_multiples(world_size, others)} "
                    f"processes (meshfit run --nproc N) or change the plan"
                )
            return dataclasses.replace(self, dp=world_size // others)
        if self.world_size != world_size:
            fits = self.with_dp_for(world_size)
            hint = f"use {fits}" if fits else "change the degrees so their product matches"
            raise MeshfitError(
                f"plan {self} uses {self.world_size} processes but {world_size} were "
                f"started; {hint}, or start {self.world_size} processes "
                f"(meshfit run --nproc {self.world_size})"
            )
        return self

    def with_dp_for(self, world_size: int) -> Plan | None:
        """The same plan with dp chosen to fill `world_size`, or None if it cannot."""
        if world_size % self.processes_per_replica:
            return None
        return dataclasses.replace(self, dp=world_size // self.processes_per_replica)

    def validate(self) -> None:
        """Refuse a plan whose options do not go together, saying what would.

        Every product of dp x fsdp x tp x pp is built; what is refused here are the
        options that PyTorch's pieces do not combine."""
        if self.precision == "fp16" and (self.pp > 1 or self.uses_fsdp):
            raise MeshfitError(
                f"precision='fp16' (gradient scaling) is not supported with plan {self} "
                f"(pipeline stages or FSDP2); use precision='bf16', which needs no scaler"
            )
        if self.precision == "fp8" and self.tp > 1:
            raise MeshfitError(
                f"precision='fp8' does not combine with tensor parallel yet (plan {self}): "
                f"meshfit's tp plans do not use torchao's float8 layouts; use fp8 with "
                f"dp/fsdp/pp (e.g. 'fsdp={self.tp * self.fsdp},precision=fp8'), or "
                f"precision='bf16' with tp"
            )
        averaged = self.fsdp > 1 or (self.dp or 1) > 1 or self.cp > 1
        if self.schedule == "zero-bubble" and self.pp > 1 and averaged:
            # Measured: dp=2 or fsdp=2 with pp=2 zero-bubble trained a different run from
            # step 1 on, and so did cp=2 (its ranks' gradients are averaged by the same
            # DDP / FSDP2, 7.0e-4 apart over 3 steps). The schedule computes weight
            # gradients in a deferred pass, after DDP / FSDP2 have already reduced them.
            what = (
                "context parallel" if not (self.fsdp > 1 or (self.dp or 1) > 1) else "data parallel"
            )
            raise MeshfitError(
                f"schedule='zero-bubble' does not combine with {what} (plan {self}): "
                f"it computes weight gradients after DDP/FSDP2 have reduced them over the "
                f"ranks, so each would train on partial gradients; use "
                f"schedule='interleaved-1f1b' (the next smallest bubble) or '1f1b'"
            )
        micro, pp, schedule = self.num_microbatches, self.pp, self.schedule
        rule = SCHEDULE_TABLE[schedule].microbatch_rule
        if pp > 1 and rule == "at_least" and micro < pp:  # torch raised a ValueError
            raise MeshfitError(
                f"schedule {schedule!r} needs at least as many micro-batches as stages "
                f"(pp={pp}), not {micro}; use microbatches={pp} or more, or schedule='gpipe'"
            )
        if pp > 1 and rule == "multiple" and micro % pp:
            raise MeshfitError(
                f"schedule {schedule!r} needs microbatches to be a multiple of pp={pp}, "
                f"not {micro}; use microbatches={max(pp, micro // pp * pp)}"
            )
        loss_ranks = (self.dp or 1) * self.fsdp * self.cp
        if self.ep > 1 and self.dp is not None and loss_ranks % self.ep:
            raise MeshfitError(
                f"ep={self.ep} borrows its ranks from dp x fsdp x cp = {loss_ranks} in plan "
                f"{self}, and {self.ep} does not divide {loss_ranks}; use an ep that divides "
                f"it, or make dp x fsdp x cp a multiple of {self.ep}"
            )
        if not self.reshard_after_forward and self.dp is not None and not self.uses_fsdp:
            raise MeshfitError(
                f"reshard_after_forward=False applies to sharded data parallel, but plan "
                f"{self} has none; add fsdp=N or drop the option"
            )

    # ---- text form ---------------------------------------------------------------
    def __str__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dp":
                parts.append("dp=auto" if value is None else f"dp={value}")
            elif value != f.default:
                parts.append(f"{f.name}={_format_value(value)}")
        return ",".join(parts)

    @classmethod
    def check_text(cls, text: str) -> None:
        """Refuse bad plan text early (the CLI, before any worker starts); "auto" and
        "auto,precision=bf16" are for the planner and pass when their fields do."""
        head, _, rest = text.replace(" ", "").partition(",")
        if head == "auto":
            if rest:
                cls.parse(rest)
            return
        cls.parse(text).validate()

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Read a plan from "dp=2,tp=2,precision=bf16" (the form `str(plan)` writes)."""
        if not isinstance(text, str):
            raise MeshfitError(
                f"a plan's text form is a string such as 'dp=2,tp=2', not "
                f"{type(text).__name__}; pass a Plan(...) for the plan itself"
            )
        known = {f.name: f for f in fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not raw.strip():
                raise MeshfitError(
                    f"cannot read plan item {item!r}: write key=value pairs separated by "
                    f"commas, e.g. 'dp=2,tp=2'"
                )
            if key not in known:
                raise MeshfitError(f"unknown plan field {key!r}; known fields: {', '.join(known)}")
            if key in values:
                raise MeshfitError(f"plan field {key!r} is given twice in {text!r}")
            values[key] = _parse_value(key, raw.strip())
        return cls(**values)


def is_auto(plan: Any) -> bool:
    """Whether `plan` is the text "auto..." that asks the planner to choose (kept here,
    not in meshfit.planner, so the check costs no planner import)."""
    return isinstance(plan, str) and plan.replace(" ", "").split(",")[0] == "auto"


def _parse_value(key: str, raw: str) -> object:
    if key == "dp" and raw == "auto":
        return None
    if key == "microbatches" and raw in ("auto", "none", "None"):
        return None
    if key in (*DEGREES, "ep", "microbatches"):
        try:
            return int(raw)
        except ValueError:
            raise MeshfitError(f"plan field {key} needs a whole number, not {raw!r}") from None
    if key in BOOLEAN_FIELDS:
        lowered = raw.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise MeshfitError(f"plan field {key} needs true or false, not {raw!r}")
    return raw


def _format_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshfitError(f"Plan {name} must be a whole number >= 1, not {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise MeshfitError(
            f"Plan {name}={value!r} is not one of: {', '.join(repr(c) for c in choices)}"
        )


def _nearest_multiples(n: int, k: int) -> str:
    below = (n // k) * k
    above = below + k
    return f"{below} or {above}" if below else f"{above}"
