"""The search: every plan for a world size, those that do not fit or are refused dropped,
the rest ranked by predicted throughput.

Plans are enumerated the way the Plan is built: dp x fsdp x tp x pp = world size (tp at
most the devices of a node and a divisor of the heads and split widths, pp at most the
blocks), then for pipelines the micro-batches (pp, 2 pp, 4 pp, 8 pp) and the schedule,
then recomputation (none, selective, full) and offload. Precision is the user's (it
changes the numbers, so the planner does not choose it). Every candidate costs a few
arithmetic operations (the profile is measured once, the pipeline cut is cached per stage
count), so a thousand GPUs plan in well under a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshfit.errors import MeshfitError
from meshfit.plan import SCHEDULES, Plan
from meshfit.planner.compiled_memory import count_compiled
from meshfit.planner.estimate import USABLE_MEMORY, Estimate, _gib, estimate_profile
from meshfit.planner.hardware import Hardware
from meshfit.planner.profile import ModelProfile, profile_model

# meshfit.parallel.pipeline is imported where it is used (see estimate.py for why).


@dataclass
class Dropped:
    plan: Plan
    reason: str
    need: float = 0.0  # bytes per rank, for a plan dropped because it does not fit


@dataclass
class SearchResult:
    """The ranked plans (best first) and the ones dropped, with why."""

    ranked: list[Estimate]
    dropped: list[Dropped] = field(default_factory=list)
    hardware: Hardware | None = None
    profile: ModelProfile | None = None  # what the plans were estimated from
    precision: str = "fp32"

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            reasons = sorted({d.reason.split(":")[0] for d in self.dropped})
            raise MeshfitError(
                f"no plan fits: all {len(self.dropped)} were dropped ({'; '.join(reasons[:4])}); "
                f"use more devices, a smaller batch, or recomputation/offload"
            )
        return self.ranked[0]

    def table(self, limit: int = 10) -> str:
        """The ranked plans as a text table, then a count of the dropped ones by reason."""
        rows = [("plan", "memory/rank", "step", "tokens/s", "MFU", "fits")]
        for e in self.ranked[:limit]:
            t = e.step_time
            rows.append(
                (
                    str(e.plan),
                    _gib(e.memory.total),
                    f"{t.total * 1e3:.1f} ms" if t else "-",
                    f"{e.tokens_per_s:,.0f}" if e.tokens_per_s else "-",
                    f"{100 * e.mfu:.1f}%" if e.mfu else "-",
                    "yes" if e.fits else ("no" if e.fits is False else "?"),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        if len(self.ranked) > limit:
            lines.append(f"... and {len(self.ranked) - limit} more that fit")
        if not self.ranked:
            lines = self._nearest()
        if self.dropped:
            counts: dict[str, int] = {}
            for d in self.dropped:
                key = d.reason.split(":")[0]
                counts[key] = counts.get(key, 0) + 1
            lines.append(
                "dropped: "
                + "; ".join(
                    f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda x: -x[1])
                )
            )
        return "\n".join(lines)

    def _nearest(self) -> list[str]:
        """When no plan fits: the three that come nearest in memory, by how much each is
        over, and what would make one fit."""
        near = sorted((d for d in self.dropped if d.need), key=lambda d: d.need)[:3]
        if not near or self.hardware is None:
            if any(d.reason.startswith("batch does not divide") for d in self.dropped):
                return [
                    "no plan fits: the global batch divides over no plan's data-parallel "
                    "ranks and micro-batches; give a larger one (--batch-size, a multiple "
                    "of the device count) or fewer devices"
                ]
            return ["no plan fits"]
        usable = self.hardware.device_memory * USABLE_MEMORY
        lines = ["no plan fits; the nearest in memory:"]
        lines += [
            f"  {d.plan}: {_gib(d.need)} per rank, over by {_gib(d.need - usable)}" for d in near
        ]
        levers = [
            f"{near[0].need / usable:.1f}x the devices for the nearest (--nproc, --nodes: "
            f"fsdp and pp shard the model state, cp the sequence)",
            "a smaller global batch (--batch-size)",
        ]
        tokens = self.profile.tokens_per_sample if self.profile is not None else 1
        if tokens > 1:
            levers.append("shorter sequences (--seq-len)")
            if tokens < CP_FROM_TOKENS:
                levers.append(f"cp plans are searched from {CP_FROM_TOKENS:,} tokens")
        if self.precision == "fp32":
            levers.append("bf16 (--precision bf16) halves parameters and activations")
        return [*lines, "to fit: " + "; ".join(levers)]


@dataclass
class ModelLimits:
    """What the model itself rules out (from its profile), each with the reason."""

    num_blocks: int
    # blocks with trainable parameters: every pipeline stage needs one (pipeline/costs.py)
    stage_blocks: int = 1 << 30
    max_tp: int = 1 << 30
    tp_error: str | None = None
    pp_error: str | None = None
    fsdp_error: str | None = None  # FSDP2 cannot replace its weights
    batchnorm: bool = False  # one micro-batch only (meshfit refuses more)
    # a coupled loss or a statistic of the batch the forward reads (coupling/batch.py's
    # planned_refusal): no data parallel, one micro-batch
    split_error: str | None = None
    cp_error: str | None = None  # why context parallel cannot cut its sequences
    sequence: int = 1  # tokens per sample (1: no token sequence to cut)
    experts: int = 0  # experts per MoE layer (0: nothing for expert parallel to place)
    # blocks where a pipeline stage may start (profile.stage_starts), and why not the
    # others; None: any
    stage_starts: list[int] | None = None
    stage_starts_differing: str = ""

    @classmethod
    def of(cls, profile: ModelProfile) -> ModelLimits:
        return cls(
            num_blocks=len(profile.blocks),
            stage_blocks=sum(1 for b in profile.blocks if b.params > 0 and b.trains),
            max_tp=profile.max_tp,
            tp_error=profile.tp_error,
            pp_error=profile.pp_error,
            fsdp_error=profile.own_weights_error,
            batchnorm=profile.has_batchnorm,
            split_error=profile.split_error,
            cp_error=profile.cp_error,
            sequence=profile.tokens_per_sample,
            experts=profile.experts,
            stage_starts=None
            if profile.stage_starts is None or all(profile.stage_starts)
            else [i for i, ok in enumerate(profile.stage_starts) if ok],
            stage_starts_differing=profile.stage_starts_differing,
        )


def candidate_plans(
    world_size: int,
    *,
    limits: ModelLimits,
    batch_size: int,
    devices_per_node: int,
    precision: str = "fp32",
    offload: bool = True,
) -> tuple[list[Plan], list[Dropped]]:
    """Every plan the search considers, and those refused before costing them."""
    plans: list[Plan] = []
    dropped: list[Dropped] = []
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            for cp in _divisors(world_size // (pp * tp)):
                if cp > 1 and limits.sequence < CP_FROM_TOKENS:
                    continue  # no long token sequence: cp costs more than it saves
                for fsdp in _divisors(world_size // (pp * tp * cp)):
                    dp = world_size // (pp * tp * cp * fsdp)
                    for ep in _expert_degrees(dp * fsdp * cp, limits):
                        base = Plan(
                            dp=dp, fsdp=fsdp, cp=cp, ep=ep, tp=tp, pp=pp, precision=precision
                        )
                        reason = _refusal(base, limits, devices_per_node)
                        if reason:
                            dropped.append(Dropped(base, reason))
                            continue
                        for plan in _variants(base, offload and not limits.fsdp_error, limits):
                            why = _refusal_of_variant(plan, batch_size, limits)
                            if why:
                                dropped.append(Dropped(plan, why))
                            else:
                                plans.append(plan)
    return plans, dropped


# Context parallel is searched from this many tokens per sequence: below it each rank's
# K/V gathers and its share of the exact mask cost more than the activations it saves
# (BENCHMARKS.md, "Context parallel"), and the search over 1,024 GPUs took 20 s with cp
# at every length, 3 s without.
CP_FROM_TOKENS = 4096


def _expert_degrees(loss_ranks: int, limits: ModelLimits) -> list[int]:
    """ep=1, and for a mixture of experts each ep that divides both the loss ranks it
    borrows and the experts, beside dp, fsdp, cp, tp and pp (beside tp each tp rank
    computes the experts whole: the estimate counts them so)."""
    if not limits.experts:
        return [1]
    return [e for e in _divisors(loss_ranks) if limits.experts % e == 0]


def _refusal(plan: Plan, limits: ModelLimits, per_node: int) -> str:
    if plan.tp > 1 and limits.tp_error:
        return f"refused: {limits.tp_error}"
    if plan.tp > 1 and limits.max_tp % plan.tp:
        return (
            f"refused: tp={plan.tp} does not divide the heads/widths (largest tp {limits.max_tp})"
        )
    if plan.tp > per_node:
        return f"refused: tp={plan.tp} would span nodes ({per_node} devices per node)"
    if plan.pp > 1 and limits.pp_error:
        return f"refused: {limits.pp_error}"
    blocks = min(limits.num_blocks, limits.stage_blocks)
    if plan.pp > 1 and plan.pp > blocks:
        return f"refused: pp={plan.pp} exceeds the model's {blocks} blocks with parameters"
    if plan.pp > 1 and _too_few_starts(plan.pp, limits):
        return _too_few_starts(plan.pp, limits)
    if limits.fsdp_error and plan.uses_fsdp:
        return f"refused: {limits.fsdp_error}"
    if limits.split_error and plan.data_parallel_size > 1:
        return f"refused: {limits.split_error}"
    if plan.cp > 1 and limits.cp_error:
        return f"refused: {limits.cp_error} (cp)"
    if plan.cp > 1 and limits.sequence % (2 * plan.cp):
        return (
            f"refused: a sequence of {limits.sequence} tokens does not cut into 2 x cp = "
            f"{2 * plan.cp} chunks"
        )
    return ""


def why_refused(plan: Plan, limits: ModelLimits, devices_per_node: int = 8) -> str | None:
    """Why meshfit would refuse `plan` (dp resolved) for this model, as the search
    knows it, or None: what the search never proposes."""
    reason = _refusal(plan, limits, devices_per_node)
    if reason:
        return reason
    # a pipeline plan left open runs BatchNorm as one micro-batch under GPipe (prepare)
    if limits.batchnorm and plan.num_microbatches > 1 and not plan.leaves_pipeline_open:
        return "refused: BatchNorm would normalise each micro-batch on its own"
    if limits.split_error and plan.num_microbatches > 1:
        return f"refused: {limits.split_error}"
    return None


def _variants(base: Plan, offload: bool, limits: ModelLimits):
    recomputation = ("none", "selective", "full") if limits.num_blocks else ("none",)
    offloads = (False, True) if offload else (False,)
    if base.pp == 1:
        for ckpt in recomputation:
            for off in offloads:
                yield dataclasses.replace(base, checkpointing=ckpt, offload=off)
        return
    # BatchNorm, a coupled loss, or a statistic of the batch the forward reads: the one
    # micro-batch GPipe runs whole
    if limits.batchnorm or limits.split_error:
        for ckpt in recomputation:
            yield dataclasses.replace(base, microbatches=1, schedule="gpipe", checkpointing=ckpt)
        return
    for factor in (1, 2, 4, 8):
        for schedule in SCHEDULES:
            for ckpt in recomputation:
                for off in offloads:
                    yield dataclasses.replace(
                        base,
                        microbatches=base.pp * factor,
                        schedule=schedule,
                        checkpointing=ckpt,
                        offload=off,
                    )


def _refusal_of_variant(plan: Plan, batch_size: int, limits: ModelLimits) -> str:
    from meshfit.plan import VIRTUAL_STAGES

    unit = plan.data_parallel_size * plan.num_microbatches
    if batch_size % unit:
        return f"batch does not divide: {batch_size} over {unit} (ranks x micro-batches)"
    try:
        plan.validate()
    except MeshfitError as error:
        return f"refused: {str(error).split(';')[0]}"
    stages = plan.pp * VIRTUAL_STAGES[plan.schedule]
    if plan.pp > 1 and stages > limits.stage_blocks:
        return f"refused: {plan.schedule} needs {stages} blocks with parameters"
    if plan.pp > 1:
        return _too_few_starts(stages, limits)
    return ""


def _too_few_starts(stages: int, limits: ModelLimits) -> str:
    """Why `stages` pipeline stages cannot start where the model's blocks keep their
    arguments (pipeline/arguments.py), or ""."""
    starts = limits.stage_starts
    if starts is None or stages <= len(starts):
        return ""
    return (
        f"refused: a pipeline stage may start only at blocks {starts} (the forward gives "
        f"each block arguments by its place in the loop: {limits.stage_starts_differing}), "
        f"too few for {stages} stages"
    )


def search_profile(
    profile: ModelProfile,
    world_size: int,
    *,
    batch_size: int,
    hardware: Hardware,
    optimizer: str | float = "adamw",
    precision: str = "fp32",
    offload: bool = True,
    compiled: bool = False,
    chunked_loss: bool | int = False,
) -> SearchResult:
    """Rank every plan for `world_size` devices of `hardware` by predicted tokens/s."""
    plans, dropped = candidate_plans(
        world_size,
        limits=ModelLimits.of(profile),
        batch_size=batch_size,
        devices_per_node=hardware.devices_per_node,
        precision=precision,
        offload=offload and hardware.separate_host_memory,
    )
    fitting: list[Estimate] = []
    for plan in plans:
        if compiled and plan.pp > 1 and plan.schedule == "zero-bubble":
            dropped.append(Dropped(plan, "refused: compile=True does not run zero-bubble"))
            continue
        e = estimate_profile(
            profile,
            plan,
            batch_size=batch_size,
            hardware=hardware,
            optimizer=optimizer,
            compiled=compiled,
            chunked_loss=chunked_loss,
        )
        if e.fits:
            fitting.append(e)
        else:
            need = max(e.memory.total, e.build)
            what = "does not fit" if need == e.memory.total else "its build does not fit"
            usable = _gib(hardware.device_memory * USABLE_MEMORY)
            whole = f"{USABLE_MEMORY:.0%} of {_gib(hardware.device_memory)}"
            dropped.append(Dropped(plan, f"{what}: {_gib(need)} > {usable} ({whole})", need))
    # Fastest first; among equals the one with less memory, then the simpler plan.
    fitting.sort(key=lambda e: (-e.samples_per_s, e.memory.total, _complexity(e.plan)))
    return SearchResult(fitting, dropped, hardware, profile, precision)


def search_model(
    model: Any,
    example_inputs: Any,
    world_size: int,
    *,
    loss_fn: Any = None,
    example_targets: Any = None,
    **options: Any,
) -> SearchResult:
    """Profile `model` (or take a ModelProfile as is), then `search_profile` with
    `options`: the one path of plan_search, plan="auto" and `meshfit plan`."""
    compiled = options.get("precision", "fp32") if options.get("compiled") else None
    profile = profile_of(model, example_inputs, loss_fn, example_targets, compiled)
    return search_profile(profile, world_size, **options)


def profile_of(
    model: Any,
    example_inputs: Any,
    loss_fn: Any,
    example_targets: Any,
    compiled_precision: str | None = None,
) -> ModelProfile:
    """A ModelProfile as is, else the profile of `model` on `example_inputs` (with a
    compiled step's counts in `compiled_precision`, if given)."""
    if isinstance(model, ModelProfile):
        return model
    profile = profile_model(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets)
    if compiled_precision is not None:
        count_compiled(model, example_inputs, loss_fn, example_targets, profile, compiled_precision)
    return profile


def _complexity(plan: Plan) -> int:
    return (
        (plan.pp > 1) * 4
        + (plan.tp > 1) * 2
        + (plan.fsdp > 1)
        + ("none", "selective", "full").index(plan.checkpointing)
        + plan.offload * 3
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
