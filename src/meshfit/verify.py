"""`mf.verify` and `meshfit verify`: the user's own proof of the promise.

Train the user's model on their batch for a few steps twice, once under a plan on
worker processes and once in this process, and compare per-step losses and final
weights at a tolerance derived from the float format (`tolerance`). The report says
"same run", or "DIFFERENT run" naming the parameter that differs most, or the refusal
meshfit gave for the plan.

Why SGD with momentum by default: its update keeps the gradient's scale, so a gradient
averaged over the wrong group or counted twice moves the weights; Adam normalises the
scale away and could hide it (the equivalence tests train with SGD for the same reason).
"""

from __future__ import annotations

import copy
import gc
import importlib
import inspect
import math
import os
import pickle
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.options import LossFn, OptimizerFactory
from meshfit.plan import Plan
from meshfit.prepare import as_plan, parallelize
from meshfit.trees import map_tensors

DEFAULT_STEPS = 3

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


# ---- where the model comes from --------------------------------------------------


@dataclass(frozen=True)
class _Recipe:
    model: nn.Module
    loss_fn: LossFn | str
    options: dict[str, Any]  # mf.parallelize keywords, optimizer included


@dataclass(frozen=True)
class _Objects:
    """The model builder (or model), loss and options themselves, pickled to workers."""

    build: Callable[[], nn.Module] | nn.Module
    loss_fn: LossFn | str
    options: dict[str, Any]

    def recipe(self, seed: int) -> _Recipe:
        torch.manual_seed(seed)  # both runs start from the same weights
        if isinstance(self.build, nn.Module):
            model = copy.deepcopy(self.build)  # never train the caller's own model
        else:
            model = _check_model(self.build(), "build()")
        return _Recipe(model, self.loss_fn, self.options)


@dataclass(frozen=True)
class _Target:
    """`module:function` (meshfit verify): every process imports and calls it itself,
    so nothing of the user's needs to pickle (a lambda loss_fn is fine)."""

    target: str

    def call(self, seed: int) -> tuple[nn.Module, Any, LossFn | str, dict[str, Any]]:
        fn = load_target(self.target)
        torch.manual_seed(seed)  # both runs start from the same weights
        result = fn()
        what = f"{self.target}()"
        if not isinstance(result, tuple) or len(result) not in (3, 4):
            raise MeshfitError(
                f"{what} must return (model, batch, loss_fn) or (model, batch, loss_fn, "
                f"options), not {_describe(result)}"
            )
        built, batch, loss_fn, *rest = result
        options = rest[0] if rest else {}
        if not isinstance(options, Mapping):
            raise MeshfitError(
                f"the 4th item {what} returns is a dict of mf.parallelize options, not "
                f"{_describe(options)}"
            )
        _check_options(options, f"the options {what} returns hold")
        if callable(built) and not isinstance(built, nn.Module):
            built = _check_model(built(), f"the model builder {what} returned")
        model = _check_model(built, f"the first item {what} returns")
        return model, batch, loss_fn, dict(options)

    def recipe(self, seed: int) -> _Recipe:
        model, _, loss_fn, options = self.call(seed)
        return _Recipe(model, loss_fn, _with_default_optimizer(options))


def load_target(target: str) -> Callable[[], Any]:
    """The function `module:function` names, imported."""
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise MeshfitError(
            f"name the function as module:function, e.g. mypkg.train:build_model_and_batch, "
            f"not {target!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only when the target itself is missing; a missing import inside it is the
        # user's bug and keeps its traceback.
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise MeshfitError(
            f"cannot import {module_name!r} ({exc}); run from the directory that holds it "
            f"or add that directory to PYTHONPATH"
        ) from None
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise MeshfitError(f"{module_name!r} has no {name!r}")
    if not callable(fn):
        raise MeshfitError(f"{target} is not a function but {_describe(fn)}")
    return fn


def _check_model(model: Any, what: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise MeshfitError(f"{what} must be a torch.nn.Module, not {_describe(model)}")
    return model


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__


def _with_default_optimizer(options: Mapping[str, Any]) -> dict[str, Any]:
    options = dict(options)
    if options.get("optimizer") is None:
        options["optimizer"] = sgd_momentum
    return options


# ---- the runs ----------------------------------------------------------------------


# Options that only say how tp / pp split the model: the one-process reference drops
# them (parallelize refuses them without their form).
FORM_OPTIONS = ("tp_plan", "pp_split")


def _train(
    recipe: _Recipe,
    plan: Plan | str | None,
    batches: list[Any],
    reference: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """One run: parallelize under `plan` (the model and the batches' floating-point
    tensors in `dtype`, when given), a step per batch; the per-step losses, the whole
    final state (gathered, so call it on every rank) and how far apart the ranks'
    copies of a parameter are."""
    options = recipe.options
    if reference:
        options = {k: v for k, v in options.items() if k not in FORM_OPTIONS}
    model = recipe.model
    if dtype is not None:
        model = model.to(dtype)
        batches = [
            map_tensors(b, lambda t: t.to(dtype) if t.is_floating_point() else t) for b in batches
        ]
    engine = parallelize(model, plan, loss_fn=recipe.loss_fn, **options)
    losses = [float(engine.step(batch)) for batch in batches]
    gap, name = (0.0, None) if reference else replica_gap(engine)
    return {"losses": losses, "state": engine.full_state_dict(), "replicas": (gap, name)}


def replica_gap(engine: Any) -> tuple[float, str | None]:
    """The largest relative difference between two ranks' copies of the same piece of a
    trained parameter, and its name ((0.0, None) when all copies are equal). A copy is
    what a rank holds of a parameter: the whole of an unsplit one (dp replicas, the
    parameters tp leaves whole, pp's tied copies), or the shard at its coordinates on
    the mesh dimensions that split it. A correct run updates every copy from the same
    gradient; copies apart mean a gradient that was not (fully) reduced, which the
    gathered state hides (it holds one rank's copy). Call on every rank."""
    import torch.distributed as dist
    import xxhash

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0, None
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    pieces = {
        _piece_key(name, p): _local(p).detach().cpu().contiguous()
        for name, p in engine.parallel_model.named_parameters()
        if id(p) in trained
    }
    digests = {
        k: xxhash.xxh3_64_hexdigest(v.view(-1).view(torch.uint8).numpy()) for k, v in pieces.items()
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    apart = {k for k in digests if len({d[k] for d in everyone if k in d}) > 1}
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, {k: pieces[k] for k in sorted(apart)})  # bitwise apart only
    worst, where = 0.0, None
    for key in sorted(apart):
        copies = [h[key] for h in held if key in h]
        for other in copies[1:]:
            gap = weight_differences({"p": other}, {"p": copies[0]})["p"]
            if gap > worst:
                worst, where = gap, key[0]
    return worst, where


def _piece_key(name: str, param: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """(name, this rank's coordinates on the mesh dimensions that split the parameter):
    the ranks with the same key hold copies of the same piece."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return name, ()
    coordinate = param.device_mesh.get_coordinate() or []
    split = [c for c, placement in zip(coordinate, param.placements, strict=False)
             if not placement.is_replicate()]  # fmt: skip
    return name, tuple(split)


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _plan_worker(
    source: _Objects | _Target,
    plans: list[str],
    batches: list[Any],
    seed: int,
    dtypes: list[torch.dtype | None],
):
    """On each worker: every plan in turn, on the same process group. A refusal is not
    caught here: the launcher stops every worker (a rank that refused alone would
    otherwise leave its peers in a collective) and the parent asks again plan by plan."""
    results = [
        _train(source.recipe(seed), plan, batches, dtype=dtype)
        for plan, dtype in zip(plans, dtypes, strict=True)
    ]
    # Only rank 0's result reaches the caller; the others need not send their copies.
    return results if int(os.environ.get("RANK", "0")) == 0 else None


def _launch_plans(
    source: _Objects | _Target,
    plans: list[str],
    batches: list[Any],
    seed: int,
    nproc: int,
    devices: str | Sequence[int] | None,
    threads: int | None,
    dtypes: list[torch.dtype | None],
) -> list[dict[str, Any]]:
    """Results (or {"refused": message}) of every plan, each in its dtype (None: the
    model's own), in one launch when none is refused inside the workers (a launch costs
    seconds of start-up)."""
    from meshfit.launch import launch

    try:
        return launch(
            _plan_worker,
            nproc=nproc,
            args=(source, plans, batches, seed, dtypes),
            devices=devices,
            threads=threads,
        )
    except MeshfitError as exc:
        if len(plans) == 1:
            return [{"refused": str(exc)}]
    # Some plan was refused: run each alone, so each gets its own verdict.
    return [
        _launch_plans(source, [plan], batches, seed, nproc, devices, threads, [dtype])[0]
        for plan, dtype in zip(plans, dtypes, strict=True)
    ]


# ---- the entry points ----------------------------------------------------------------


def verify(
    build: Callable[[], nn.Module] | nn.Module,
    plan: Plan | str | None,
    batch: Any,
    *,
    loss_fn: LossFn | str,
    steps: int | None = None,
    nproc: int | None = None,
    optimizer: OptimizerFactory | None = None,
    rtol: float | None = None,
    seed: int = 0,
    devices: str | Sequence[int] | None = None,
    threads: int | None = None,
    in_float64: bool = True,
    **parallelize_options: Any,
) -> VerifyReport:
    """Train the model a few steps under `plan` on worker processes and in this process,
    and report whether it is the same run.

    build: a function that returns a fresh model (called after ``torch.manual_seed(seed)``
        in each run), or a model (copied; yours is never trained). It, `loss_fn`,
        `optimizer`, the options and the batch go to the workers by pickle: define
        functions with ``def`` in a .py module (not a lambda, a nested function or a
        notebook cell), or use ``functools.partial`` of one.
    plan: the plan to check, e.g. "tp=2,pp=2" or a Plan.
    batch: the global batch ``(inputs, targets)``, used at every step; or a list of
        batches (tuples), one per step.
    loss_fn: as for `mf.parallelize`.
    steps: training steps (default 3; with a list of batches, its length).
    nproc: worker processes (default: the plan's world size, taking dp=1 when the plan
        leaves dp open; for a dp-only plan the launcher's default, 2 CPU workers or
        every GPU).
    optimizer: a function of the parameters (default SGD, lr 0.1, momentum 0.9: it keeps
        the gradient's scale in the update, where Adam would hide a wrongly scaled one).
    rtol: the relative tolerance, of losses and weights alike (default
        `tolerance(model dtype, plan precision)` for weights and `loss_tolerance(...)`
        for each step's loss: they differ under fp8).
    seed: ``torch.manual_seed(seed)`` before each build (default 0).
    devices, threads: as for `mf.launch`.
    in_float64: train both runs in float64 (the model's floating-point parameters and
        buffers, and the batch's floating-point tensors, converted), where rounding
        cannot hide a small difference: a gradient off by one part in a million is a
        different run. A model that fails in float64 is compared in its own dtype, and
        the report's note says why. False, or a plan with bf16 / fp16 / fp8 precision:
        the model's own dtype.
    parallelize_options: any other `mf.parallelize` keyword (grad_clip, tp_plan, ...),
        given to both runs.

    A plan meshfit refuses (before or while running it) gives a report whose verdict is
    the refusal; errors in the arguments of verify itself raise MeshfitError.
    """
    _check_options(parallelize_options)
    options = _with_default_optimizer({"optimizer": optimizer, **parallelize_options})
    if not isinstance(build, nn.Module) and not callable(build):
        raise MeshfitError(
            f"verify needs a function that returns a fresh model (or a model), not "
            f"{_describe(build)}"
        )
    source = _Objects(build, loss_fn, options)
    _check_sendable(source, batch)
    return verify_many(
        source,
        [plan],
        batch,
        steps=steps,
        nproc=nproc,
        rtol=rtol,
        seed=seed,
        devices=devices,
        threads=threads,
        in_float64=in_float64,
    )[0]


def verify_target(
    target: str,
    plan: Plan | str | None,
    *,
    steps: int | None = None,
    nproc: int | None = None,
    rtol: float | None = None,
    seed: int = 0,
    devices: str | Sequence[int] | None = None,
    threads: int | None = None,
    in_float64: bool = True,
) -> VerifyReport:
    """`meshfit verify`: as `verify`, with model, batch and loss from the function that
    `target` ("module:function") names; see `meshfit verify --help` for its contract."""
    source = _Target(target)
    _, batch, _, _ = source.call(seed)  # also checks the contract before any launch
    return verify_many(
        source,
        [plan],
        batch,
        steps=steps,
        nproc=nproc,
        rtol=rtol,
        seed=seed,
        devices=devices,
        threads=threads,
        in_float64=in_float64,
    )[0]


def verify_many(
    source: _Objects | _Target,
    plans: Sequence[Plan | str | None],
    batch: Any,
    *,
    steps: int | None = None,
    nproc: int | None = None,
    rtol: float | None = None,
    seed: int = 0,
    devices: str | Sequence[int] | None = None,
    threads: int | None = None,
    in_float64: bool = True,
) -> list[VerifyReport]:
    """Several plans against one reference run; the plans of one process count share
    one launch (`meshfit demo --verify`)."""
    _refuse_inside_workers()
    if not isinstance(in_float64, bool):
        raise MeshfitError(f"in_float64 must be True or False, not {in_float64!r}")
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise MeshfitError(f"nproc must be a whole number >= 1, not {nproc!r}")
    if rtol is not None and not (isinstance(rtol, (int, float)) and rtol >= 0):
        raise MeshfitError(f"rtol must be a number >= 0, not {rtol!r}")
    batches = _batches(batch, steps)
    # Each plan resolved against its process count here: a plan that cannot run is
    # refused before any worker starts.
    planned: list[tuple[str, int, Plan | None, str | None]] = []
    for plan in plans:
        try:
            parsed = as_plan(plan)
            count = nproc or _default_nproc(parsed, devices)
            resolved = parsed.resolve(count)
            resolved.validate()
            planned.append((str(resolved), count, resolved, None))
        except MeshfitError as exc:
            shown = plan if isinstance(plan, str) else str(plan)
            planned.append((shown, nproc or 0, None, str(exc)))
    results: dict[int, dict[str, Any]] = {}
    runnable = [i for i, p in enumerate(planned) if p[2] is not None]
    references: dict[str, dict[str, Any]] = {}
    if runnable:
        for precision in {planned[i][2].precision for i in runnable}:
            wanted = torch.float64 if in_float64 and precision == "fp32" else None
            references[precision] = _reference(
                source, precision, batches, seed, devices, threads, wanted
            )
    for count in sorted({planned[i][1] for i in runnable}):
        group = [i for i in runnable if planned[i][1] == count]
        dtypes = [references[planned[i][2].precision]["run_dtype"] for i in group]
        outcome = _launch_plans(
            source, [planned[i][0] for i in group], batches, seed, count, devices, threads, dtypes
        )
        results.update(zip(group, outcome, strict=True))
    reports = []
    for i, (shown, count, resolved, refused) in enumerate(planned):
        if resolved is None:
            report = VerifyReport(
                plan=shown, nproc=count, rtol=math.nan if rtol is None else rtol, refused=refused
            )
            reports.append(report)
            continue
        reports.append(_compare(shown, count, results[i], references[resolved.precision], rtol))
    return reports


def _compare(
    plan: str, nproc: int, got: dict[str, Any], ref: dict[str, Any], rtol: float | None
) -> VerifyReport:
    common = dict(
        plan=plan, nproc=nproc, dtype=str(ref["dtype"]).removeprefix("torch."), note=ref["note"]
    )
    loss_rtol = ref["loss_rtol"] if rtol is None else rtol  # a given rtol: for both
    rtol = ref["rtol"] if rtol is None else rtol
    common["loss_rtol"] = None if loss_rtol == rtol else loss_rtol
    if "refused" in got:
        return VerifyReport(
            **common, rtol=rtol, refused=got["refused"], reference_losses=ref["losses"]
        )
    worst, name = _largest_difference(got["state"], ref["state"])
    gap, apart = got["replicas"]
    return VerifyReport(
        **common,
        rtol=rtol,
        losses=got["losses"],
        reference_losses=ref["losses"],
        max_weight_diff=worst,
        max_weight_name=name,
        weights_moved=ref["moved"],
        replica_gap=gap,
        replica_name=apart,
    )


def _largest_difference(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> tuple[float, str | None]:
    """The largest relative weight difference and its tensor's name (a NaN is the worst)."""
    diffs = weight_differences(got, ref)
    name = max(
        sorted(diffs), key=lambda k: math.inf if math.isnan(diffs[k]) else diffs[k], default=None
    )
    return (0.0, None) if name is None else (diffs[name], name)


def _reference(
    source: _Objects | _Target,
    precision: str,
    batches: list[Any],
    seed: int,
    devices: str | Sequence[int] | None,
    threads: int | None,
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """The one-process run, in this process; on a GPU machine whose workers are told to
    use the CPU (devices="cpu"), in one worker process instead, so that both runs use
    the same kind of device (this process would take the GPU)."""
    from meshfit.launch import launch, plan_workers

    here = "cuda" if torch.cuda.is_available() else "cpu"
    if plan_workers(1, devices, threads).device_kind != here:
        args = (source, precision, batches, seed, dtype)
        return launch(_reference_run, nproc=1, args=args, devices=devices, threads=threads)
    return _reference_run(source, precision, batches, seed, dtype)


def _reference_run(
    source: _Objects | _Target,
    precision: str,
    batches: list[Any],
    seed: int,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The one-process run, in `dtype` when the model runs in it (else in its own, with
    a note that says why); "run_dtype" is the one the plans' runs must use."""
    plan = None if precision == "fp32" else Plan(precision=precision)
    note = None
    if dtype is not None:
        try:
            return _reference_in(source.recipe(seed), plan, batches, dtype, None)
        except Exception as failure:  # noqa: BLE001 - compared in its own dtype instead
            # meshfit's first-step explanation wraps the model's own error: name that one
            error = failure.__cause__ or failure
            note = (
                f"compared in the model's own dtype: it does not train in "
                f"{str(dtype).removeprefix('torch.')} ({type(error).__name__}: "
                f"{(str(error).splitlines() or [''])[0]})"
            )
    return _reference_in(source.recipe(seed), plan, batches, None, note)


def _reference_in(
    recipe: _Recipe,
    plan: Plan | None,
    batches: list[Any],
    run_dtype: torch.dtype | None,
    note: str | None,
) -> dict[str, Any]:
    initial = {k: v.detach().cpu().clone() for k, v in recipe.model.state_dict().items()}
    dtype = run_dtype or next(
        (p.dtype for p in recipe.model.parameters() if p.is_floating_point()), None
    )
    run = _train(recipe, plan, batches, reference=True, dtype=run_dtype)
    if torch.cuda.is_initialized():
        gc.collect()  # the engine (with reference cycles) and its GPU tensors
        torch.cuda.empty_cache()  # hand the reference's GPU memory to the workers
    common = [k for k in initial if k in run["state"]]
    final = {k: run["state"][k] for k in common}
    moved = max(weight_differences(final, {k: initial[k] for k in common}).values(), default=0.0)
    precision = plan.precision if plan is not None else "fp32"
    rtol = tolerance(dtype or torch.float32, precision)
    loss_rtol = loss_tolerance(dtype or torch.float32, precision)
    return {
        **run,
        "dtype": dtype or torch.float32,
        "run_dtype": run_dtype,
        "note": note,
        "rtol": rtol,
        "loss_rtol": loss_rtol,
        "moved": moved,
    }


def _default_nproc(plan: Plan, devices: str | Sequence[int] | None) -> int:
    """The plan's world size, with dp=1 when the plan leaves dp open, except a plan of
    dp alone: the launcher's default count (2 CPU workers, or every GPU)."""
    if plan.world_size is not None:
        return plan.world_size
    if plan.processes_per_replica > 1:
        return plan.processes_per_replica
    from meshfit.launch import plan_workers

    return plan_workers(None, devices, None).nproc


def _batches(batch: Any, steps: int | None) -> list[Any]:
    """One batch per step: `batch` repeated, or the list of batches as given."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise MeshfitError(f"steps must be a whole number >= 1, not {steps!r}")
    if _is_batch_list(batch):
        if steps is not None and steps != len(batch):
            raise MeshfitError(
                f"{len(batch)} batches were given, one per step, but steps={steps}; give "
                f"{steps} batches or leave steps out"
            )
        return list(batch)
    return [batch] * (steps or DEFAULT_STEPS)


def _is_batch_list(batch: Any) -> bool:
    """A list of batches (each a pair tuple or, for loss_fn="model", a mapping), not one
    batch written as a list [inputs, targets]."""
    return (
        isinstance(batch, list)
        and bool(batch)
        and all(
            isinstance(b, Mapping) or (isinstance(b, (tuple, list)) and len(b) == 2) for b in batch
        )
    )


def _check_options(options: Mapping[str, Any], what: str = "verify does not take") -> None:
    """Refuse a keyword mf.parallelize does not take (loss_fn is verify's own argument)."""
    known = [
        name
        for name, p in inspect.signature(parallelize).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "loss_fn"
    ]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise MeshfitError(
            f"{what} {', '.join(map(repr, unknown))}; the options of mf.parallelize it passes "
            f"on are: {', '.join(known)}"
        )


def _refuse_inside_workers() -> None:
    # The one-process run here would join the workers' process group instead.
    in_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if in_group or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MeshfitError(
            "verify starts its own workers and runs the one-process reference here: call "
            "it from a plain Python process, not inside a launched worker"
        )


class _Interactive(Exception):
    pass


class _Probe(pickle.Pickler):
    """Pickles to nowhere, to find what the workers could not receive: what pickle
    refuses, and functions or classes of an interactive __main__ (a notebook cell),
    which pickle by name but which a worker cannot import."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        main = sys.modules.get("__main__")
        self.interactive = not getattr(main, "__file__", None)

    def reducer_override(self, obj: Any) -> Any:
        if (
            self.interactive
            and isinstance(obj, (type, types.FunctionType))
            and getattr(obj, "__module__", None) == "__main__"
        ):
            raise _Interactive(getattr(obj, "__qualname__", repr(obj)))
        return NotImplemented


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _check_sendable(source: _Objects, batch: Any) -> None:
    """Refuse, up front and by name, what cannot travel to the worker processes."""
    items = [("build", source.build), ("loss_fn", source.loss_fn)]
    items += [(name, value) for name, value in source.options.items()]
    items.append(("batch", batch))
    fix = (
        "define it with def at the top level of a .py module and import it (not a lambda, "
        "a nested function or a notebook cell), or use functools.partial of such a function"
    )
    for name, value in items:
        try:
            _Probe().dump(value)
        except _Interactive as exc:
            raise MeshfitError(
                f"{name}: {exc} is defined interactively (a notebook cell or the REPL), so "
                f"the worker processes cannot import it; {fix}"
            ) from None
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise MeshfitError(
                f"{name} cannot be sent to the worker processes ({exc}); {fix}"
            ) from None
