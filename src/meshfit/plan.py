"""Plan: how the work of training is split over processes.

A Plan is one value that names every parallel degree and the memory/precision options.
`str(plan)` and `Plan.parse(text)` round-trip, so a plan can travel through the CLI,
logs and checkpoints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from meshfit.errors import MeshfitError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CHECKPOINTING = ("none", "full", "selective")
PRECISIONS = ("fp32", "bf16", "fp16")

# Mesh dimension order, outermost first: pipeline stages talk least often, tensor
# parallel most often, so tp ranks are adjacent (same node / NVLink domain).
MESH_DIMS = ("pp", "dp", "fsdp", "tp")

# Forms that this version of meshfit implements. Anything else is refused up front so a
# plan is never silently run another way.
IMPLEMENTED_DEGREES = {"dp", "fsdp", "tp", "pp"}
# Combinations built and tested so far (others are refused, never run another way).
# dp x tp needs data parallel over DTensor parameters (DDP cannot); dp/fsdp x pp needs
# the stages split before they are wrapped.
COMBINATIONS = ({"fsdp", "tp"}, {"tp", "pp"}, {"dp", "pp"}, {"fsdp", "pp"}, {"fsdp", "tp", "pp"})


@dataclass(frozen=True)
class Plan:
    """How to split training over `dp * fsdp * tp * pp` processes.

    dp: data-parallel replicas (DistributedDataParallel). ``None`` means "all the
        processes the other degrees leave", resolved against the world size.
    fsdp: sharded data parallel degree (FSDP2).
    tp: tensor-parallel degree.
    pp: pipeline-parallel stages.
    microbatches: how many micro-batches each rank's share of the global batch is cut
        into. Without pipelining this is gradient accumulation; ``None`` means 1
        (or 2*pp with pipelining).
    schedule: pipeline schedule, one of SCHEDULES.
    checkpointing: activation recomputation, one of CHECKPOINTING.
    offload: keep parameters, gradients and optimizer state on the CPU.
    precision: "fp32", "bf16" (autocast, fp32 master weights) or "fp16" (autocast plus
        a gradient scaler).
    """

    dp: int | None = None
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int | None = None
    schedule: str = "1f1b"
    checkpointing: str = "none"
    offload: bool = False
    precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("fsdp", "tp", "pp"):
            _check_positive_int(name, getattr(self, name))
        if self.dp is not None:
            _check_positive_int("dp", self.dp)
        if self.microbatches is not None:
            _check_positive_int("microbatches", self.microbatches)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _check_choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.offload, bool):
            raise MeshfitError(f"Plan offload must be True or False, not {self.offload!r}")

    # ---- sizes -------------------------------------------------------------------
    @property
    def degrees(self) -> dict[str, int | None]:
        """Degree of every mesh dimension, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world_size(self) -> int | None:
        """Processes this plan needs, or None while dp is unresolved."""
        if self.dp is None:
            return None
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        if self.microbatches is not None:
            return self.microbatches
        return 2 * self.pp if self.pp > 1 else 1

    @property
    def data_parallel_size(self) -> int:
        """How many ways the global batch is split (replicated and sharded data parallel)."""
        if self.dp is None:
            raise MeshfitError("call Plan.resolve(world_size) before asking for sizes")
        return self.dp * self.fsdp

    def resolve(self, world_size: int) -> Plan:
        """Fill in ``dp=None`` from the world size and check the plan fits it."""
        others = self.fsdp * self.tp * self.pp
        if self.dp is None:
            if world_size % others:
                raise MeshfitError(
                    f"plan {self} needs a multiple of fsdp*tp*pp = {others} processes, but "
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
        others = self.fsdp * self.tp * self.pp
        if world_size % others:
            return None
        return dataclasses.replace(self, dp=world_size // others)

    def check_implemented(self) -> None:
        """Refuse a plan that asks for a form this version does not build."""
        missing = [
            f"{name}={value}"
            for name, value in self.degrees.items()
            if name not in IMPLEMENTED_DEGREES and value not in (None, 1)
        ]
        if missing:
            raise MeshfitError(
                f"plan {self} asks for {', '.join(missing)}, which this version of meshfit "
                f"does not implement yet (dp, fsdp, tp and pp are built); use a plan "
                f"such as Plan(dp=N), Plan(fsdp=N), Plan(tp=N) or Plan(pp=N)"
            )
        combined = [f"{n}={v}" for n, v in self.degrees.items() if v is not None and v > 1]
        names = {c.split("=")[0] for c in combined}
        if len(combined) > 1 and names not in COMBINATIONS:
            built = " and ".join(" x ".join(sorted(c)) for c in COMBINATIONS)
            raise MeshfitError(
                f"plan {self} combines {' and '.join(combined)}; this version of meshfit "
                f"builds one form at a time, or {built}; use one of "
                f"{', '.join('Plan(' + c + ')' for c in combined)}"
            )
        if (self.pp > 1 or self.fsdp > 1) and self.precision == "fp16":
            raise MeshfitError(
                "precision='fp16' (gradient scaling) is not supported with pp or fsdp; use "
                "precision='bf16', which needs no scaler"
            )
        if self.offload:
            raise MeshfitError("offload=True is not implemented yet; use offload=False")

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
    def parse(cls, text: str) -> Plan:
        """Read a plan from "dp=2,tp=2,precision=bf16" (the form `str(plan)` writes)."""
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


def _parse_value(key: str, raw: str) -> object:
    if key == "dp" and raw == "auto":
        return None
    if key == "microbatches" and raw in ("auto", "none", "None"):
        return None
    if key in ("dp", "fsdp", "tp", "pp", "microbatches"):
        try:
            return int(raw)
        except ValueError:
            raise MeshfitError(f"plan field {key} needs a whole number, not {raw!r}") from None
    if key == "offload":
        lowered = raw.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise MeshfitError(f"plan field offload needs true or false, not {raw!r}")
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
