"""What mf.verify reports and the tolerances it judges by: the float rounding a plan may
add (by dtype and precision, scaled by steps and learning rate), the per-tensor weight
differences, the report and its table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshfit.errors import MeshfitError

# Unit roundoff (half the machine epsilon) of each float format.
_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


# The largest relative error a correct plan showed against one process, in units of
# roundoff (171, float32, gpt4 pp=4; 119 in float64), times 100 for kernels that
# reduce in another order on another CPU. tests/helpers.py has the measurement.
_AMPLIFICATION = 171


_SAFETY = 100


# Autocast rounds each matrix product's inputs to the low format, and each rank rounds
# its own share: about one roundoff apart, allowed twice (tests/test_equivalence.py).
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


# fp8: each rank scales its own activations and gradients to float8 (3 and 2 mantissa
# bits). Weights: measured 1.4e-2 relative on a tiny GPT's final weights under
# dp/fsdp/pp=2 after 4 SGD steps (the setting of tests/test_precision_fp8.py), 1.4e-3
# under verify's own SGD-momentum default (3 steps, TINY_GPT, dp/fsdp/pp=2); allowed
# about twice the first. Losses, per step: measured at most 6.0e-5 relative in the first
# setting, 4.1e-5 in the second (torchao 0.18, emulated on CPU); allowed 4e-4, about 7x.
_FP8_RTOL = 3e-2


_FP8_LOSS_RTOL = 4e-4


def tolerance(dtype: torch.dtype = torch.float32, precision: str = "fp32") -> float:
    """The largest relative difference (per step's loss, per weight tensor) a correct
    plan may show against one process, for a model in `dtype` trained at `precision`:
    1.9e-12 in float64, 1.0e-3 in float32 (its noise floor after a few steps differs
    between CPUs), 2 roundoffs of the autocast format under bf16 or fp16, 3e-2 under
    fp8 (`loss_tolerance` is the one for losses where it differs)."""
    if dtype not in _ROUNDOFF:
        raise MeshfitError(
            f"no tolerance for a model in {dtype}; pass rtol=... or use a floating-point model"
        )
    rtol = _AMPLIFICATION * _SAFETY * _ROUNDOFF[dtype]
    if precision in _AUTOCAST:
        rtol = max(rtol, 2 * _ROUNDOFF[_AUTOCAST[precision]])
    if precision == "fp8":
        rtol = max(rtol, _FP8_RTOL)
    return rtol


def loss_tolerance(dtype: torch.dtype = torch.float32, precision: str = "fp32") -> float:
    """The largest relative difference of each step's loss a correct plan may show:
    `tolerance`'s, except under fp8 for a float32 or float64 model, 4e-4 (a loss
    averages over the batch: its float8 noise is smaller than a weight tensor's)."""
    if precision == "fp8" and dtype in (torch.float32, torch.float64):
        # Measured with float32 master weights (the comment at _FP8_LOSS_RTOL): tighter
        # than float32's general 1.0e-3, whose 100x safety covers other CPUs' kernels.
        return _FP8_LOSS_RTOL
    return tolerance(dtype, precision)


def weight_differences(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Each tensor's relative difference, ||got - ref|| / ||ref|| (per tensor: an
    elementwise relative error means nothing for entries near zero), a missing tensor or
    one of another shape counting as infinitely different.

    A tensor much smaller than the model's typical weight is measured against the norm it
    would have at the typical weight (the root mean square over all floating-point
    weights) instead: a key projection's bias, say, starts at zero and has a zero
    gradient in exact arithmetic (softmax ignores it), so all it holds after training is
    rounding noise, and two correct runs' noise differ by 100% of it."""
    floats = [t for t in ref.values() if t.is_floating_point()]
    count = sum(t.numel() for t in floats)
    rms = math.sqrt(sum(t.double().square().sum().item() for t in floats) / max(count, 1))
    diffs = {}
    for key in ref.keys() | got.keys():
        a, b = got.get(key), ref.get(key)
        if a is None or b is None or a.shape != b.shape:
            diffs[key] = math.inf
            continue
        diff = (a.detach().double() - b.detach().double()).norm().item()
        scale = max(b.detach().double().norm().item(), rms * math.sqrt(b.numel()))
        diffs[key] = diff / scale if scale > 0 else diff
    return diffs


def sgd_momentum(params: Any) -> torch.optim.Optimizer:
    """verify's default optimizer: SGD, lr 0.1, momentum 0.9 (keeps the gradient's scale
    in the update, so a wrongly scaled gradient shows in the weights)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ---- the report --------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyReport:
    """One plan against one process: per-step losses of both runs, the largest relative
    weight difference and where, the tolerance, and the verdict (`ok`, `verdict`).
    `str(report)` is a table for printing."""

    plan: str
    nproc: int
    rtol: float
    dtype: str = ""  # the model's, once the one-process run has run
    losses: list[float] = field(default_factory=list)  # under the plan
    reference_losses: list[float] = field(default_factory=list)  # in one process
    max_weight_diff: float = math.nan
    max_weight_name: str | None = None
    weights_moved: float = math.nan  # largest relative change of a weight over the run
    refused: str | None = None  # meshfit's refusal of the plan, if it was refused
    loss_rtol: float | None = None  # the tolerance of each step's loss (None: rtol)
    # The largest relative difference between two ranks' copies of one piece of a trained
    # parameter (dp replicas, tp's unsplit parameters, pp's tied copies), and where.
    replica_gap: float = 0.0
    replica_name: str | None = None
    note: str | None = None  # why the runs are not in float64, when they could not be
    # for a different run: the first module whose output (or else parameter's gradient)
    # departs from one process's at the first step (locate.py); None: none does
    departs: str | None = None

    @property
    def replica_rtol(self) -> float:
        """How far apart ranks' copies may be: `rtol` without its allowance for other
        CPUs (the copies are updated on one machine, from one gradient)."""
        return self.rtol / _SAFETY

    @property
    def loss_bound(self) -> float:
        """The tolerance the losses are held to: `loss_rtol`, or `rtol` without one."""
        return self.rtol if self.loss_rtol is None else self.loss_rtol

    @property
    def loss_diffs(self) -> list[float]:
        """Relative difference of each step's loss."""
        return [_relative(a, b) for a, b in zip(self.losses, self.reference_losses, strict=True)]

    @property
    def max_loss_diff(self) -> float:
        return max(self.loss_diffs, default=math.nan)

    @property
    def ok(self) -> bool:
        """Same per-step losses within `loss_bound` and final weights within `rtol`
        (False when refused; a NaN compares as different)."""
        if self.refused is not None or not self.losses:
            return False
        losses_ok = all(d <= self.loss_bound for d in self.loss_diffs)
        replicas_ok = self.replica_gap <= self.replica_rtol
        return losses_ok and replicas_ok and self.max_weight_diff <= self.rtol

    @property
    def verdict(self) -> str:
        if self.refused is not None:
            return f"refused: {self.refused}"
        if self.ok:
            return "same run"
        if not self.replica_gap <= self.replica_rtol:
            return f"DIFFERENT run: the ranks' copies of {self.replica_name} drifted apart"
        if not self.max_weight_diff <= self.rtol:
            return f"DIFFERENT run: largest difference in {self.max_weight_name}"
        step = next(i for i, d in enumerate(self.loss_diffs, 1) if not d <= self.loss_bound)
        return f"DIFFERENT run: the loss differs at step {step}"

    def table(self) -> str:
        """The report as text: losses side by side, the weight difference, the verdict."""
        head = f"meshfit verify: plan {self.plan}"
        if self.nproc:
            head += f" on {_processes(self.nproc)} against 1 process"
        if self.reference_losses:  # known once the one-process run has run
            head += f", {len(self.reference_losses)} steps, {self.dtype}"
        lines = [head]
        if self.refused is None:
            rows = [["step", "1 process", f"plan {self.plan}", "relative difference"]]
            for step, (ref, got, diff) in enumerate(
                zip(self.reference_losses, self.losses, self.loss_diffs, strict=True), 1
            ):
                rows.append([str(step), _loss(ref), _loss(got), f"{diff:.1e}"])
            lines.append(_columns(rows))
            if self.loss_bound != self.rtol:
                lines.append(f"loss tolerance: {self.loss_bound:.1e} relative")
            lines.append(
                f"largest weight difference: {self.max_weight_diff:.1e} relative, in "
                f"{self.max_weight_name} (tolerance {self.rtol:.1e}; the weights moved by up "
                f"to {self.weights_moved:.1e} relative over the run)"
            )
            if self.replica_name is not None:
                lines.append(
                    f"largest difference between ranks' copies of a parameter: "
                    f"{self.replica_gap:.1e} relative, in {self.replica_name} (tolerance "
                    f"{self.replica_rtol:.1e})"
                )
            if self.weights_moved == 0:
                lines.append(
                    "warning: no weight changed over the run, so an equal result proves "
                    "nothing (a learning rate of 0, or a loss that does not depend on them?)"
                )
        if self.note:
            lines.append(f"note: {self.note}")
        if self.refused is None and not self.ok:
            lines.append(
                f"first departs at step 1: {self.departs}"
                if self.departs
                else "first departs: no module's output or gradient at step 1 (the "
                "difference comes later: the optimizer's update or a later step)"
            )
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def reports_table(reports: Sequence[VerifyReport], title: str | None = None) -> str:
    """Several plans against the same one-process run, one row each: the losses per
    step, the largest weight difference and the verdict."""
    steps = max((len(r.reference_losses) for r in reports), default=0)
    header = ["plan", "processes", *(f"loss, step {s}" for s in range(1, steps + 1))]
    rows = [[*header, "max weight diff", "verdict"]]
    reference = next((r.reference_losses for r in reports if r.reference_losses), None)
    if reference:
        rows.append(["1 process", "1", *map(_loss, reference), "", "(the reference)"])
    for r in reports:
        losses = [_loss(v) for v in r.losses] or ["-"] * steps
        diff = "-" if r.refused else f"{r.max_weight_diff:.1e}"
        rows.append([r.plan, str(r.nproc), *losses, diff, r.verdict])
    lines = [title] if title else []
    lines.append(_columns(rows))
    rtols = sorted({r.rtol for r in reports if r.refused is None})
    loss_rtols = sorted({r.loss_bound for r in reports if r.refused is None})
    within = (
        f"every loss and weight within {_join(rtols)} relative"
        if loss_rtols == rtols
        else f"every loss within {_join(loss_rtols)} and weight within {_join(rtols)} relative"
    )
    lines.append(
        "max weight diff: the largest relative difference of a weight tensor from the "
        f"one-process run; same run: {within}"
    )
    return "\n".join(lines)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a - b)


def _processes(n: int) -> str:
    return "1 process" if n == 1 else f"{n} processes"


def _loss(value: float) -> str:
    return f"{value:.12g}"


def _join(values: list[float]) -> str:
    return " / ".join(f"{v:.1e}" for v in values)


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip()
        for row in rows
    )
