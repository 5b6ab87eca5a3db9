"""`mf.verify` and `meshfit verify`: the user's own proof of the promise.

Train the user's model on their batch for a few steps twice, once under a plan on
worker processes and once in this process, and compare per-step losses and final
weights at a tolerance derived from the float format (`tolerance`). The report says
"same run", or "DIFFERENT run" naming the parameter that differs most and the first
module whose output or gradient departs at step 1 (locate.py), or the refusal meshfit
gave for the plan.

Why SGD with momentum by default: its update keeps the gradient's scale, so a gradient
averaged over the wrong group or counted twice moves the weights; Adam normalises the
scale away and could hide it (the equivalence tests train with SGD for the same reason).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.options import LossFn, OptimizerFactory
from meshfit.plan import Plan
from meshfit.prepare import as_plan
from meshfit.verification.locate import (  # noqa: F401 - replica_gap: tests import it here
    departure,
    replica_gap,
)

# re-exported: tests, the CLI, the demo and the planner import them from here
from meshfit.verification.report import (  # noqa: F401
    VerifyReport,
    loss_tolerance,
    reports_table,
    sgd_momentum,
    tolerance,
    weight_differences,
)
from meshfit.verification.runs import (
    NOISE_FACTOR,
    _joined,
    in_round_order,
    one_process_reference,
    rows_reversed_noise,
    train,
)
from meshfit.verification.sending import _check_sendable
from meshfit.verification.targets import (  # noqa: F401
    _check_options,
    _describe,
    _Objects,
    _Recipe,
    _Target,
    _with_default_optimizer,
    load_target,
)

DEFAULT_STEPS = 3


# ---- the runs ----------------------------------------------------------------------


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
        train(source.recipe(seed), plan, batches, dtype=dtype)
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
    batch: the global batch ``(inputs, targets)``, used at every step; with
        ``loss_fn="model"`` the mapping the model takes, labels included (a data
        collator's dict); or a list of batches, one per step.
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
            references[precision] = one_process_reference(
                source, precision, batches, seed, devices, threads, wanted
            )
    for count in sorted({planned[i][1] for i in runnable}):
        group = [i for i in runnable if planned[i][1] == count]
        dtypes = [references[planned[i][2].precision]["run_dtype"] for i in group]
        outcome = _launch_plans(
            source, [planned[i][0] for i in group], batches, seed, count, devices, threads, dtypes
        )
        results.update(zip(group, outcome, strict=True))
    job = _Job(source, batches, seed, devices, threads)
    _own_dtype_where_float64_failed(job, planned, results, references)
    _rounds_where_a_coupled_loss_is_formed_per_round(job, planned, results, references)
    if rtol is None:
        _float64_judged_by_its_noise_where_it_differs(job, planned, results, references)
    reports = []
    for i, (shown, count, resolved, refused) in enumerate(planned):
        if resolved is None:
            report = VerifyReport(
                plan=shown, nproc=count, rtol=math.nan if rtol is None else rtol, refused=refused
            )
            reports.append(report)
            continue
        reference = results[i].pop("reference", None) or references[resolved.precision]
        reports.append(_compare(shown, count, results[i], reference, rtol))
    return reports


@dataclass(frozen=True)
class _Job:
    """What every run of one verify call shares: the model's source, the batches, the
    seed and where the workers run."""

    source: _Objects | _Target
    batches: list[Any]
    seed: int
    devices: str | Sequence[int] | None
    threads: int | None


# What explain_first_failure (runtime/batch_errors.py) says of a kernel's dtype error
_REFUSES_FLOAT64 = "(the model's parameters in float64)"


def _own_dtype_where_float64_failed(
    job: _Job,
    planned: list[tuple[str, int, Plan | None, str | None]],
    results: dict[int, dict[str, Any]],
    references: dict[str, dict[str, Any]],
) -> None:
    """A plan whose run failed in float64 where the one-process run did not (a kernel
    that refuses float64 on a path only the plan takes: Qwen3-MoE's grouped matmul under
    compile=True beside dp, which one process compiles into a kernel that takes it) is
    run again in the model's own dtype, against one process in that dtype too, and the
    note says why; it is no refusal of the plan."""
    again = [
        i
        for i, got in results.items()
        if _REFUSES_FLOAT64 in got.get("refused", "")
        and references[planned[i][2].precision]["run_dtype"] == torch.float64
    ]
    own: dict[str, dict[str, Any]] = {}  # one reference per precision, its note per plan
    for i in again:
        shown, count, resolved, _ = planned[i]
        error = results[i]["refused"].split(_REFUSES_FLOAT64 + ": ", 1)[-1].split("; give ")[0]
        note = f"plan {shown} does not train in float64 ({error})"
        if resolved.precision not in own:
            own[resolved.precision] = one_process_reference(
                job.source, resolved.precision, job.batches, job.seed, job.devices,
                job.threads, None,
            )  # fmt: skip
        reference = own[resolved.precision]
        said = [f"compared in the model's own dtype: {note}", reference["note"]]
        reference = {**reference, "note": "; ".join(n for n in said if n)}
        (got,) = _launch_plans(
            job.source, [shown], job.batches, job.seed, count, job.devices, job.threads, [None]
        )
        results[i] = {**got, "reference": reference}


def _rounds_where_a_coupled_loss_is_formed_per_round(
    job: _Job,
    planned: list[tuple[str, int, Plan | None, str | None]],
    results: dict[int, dict[str, Any]],
    references: dict[str, dict[str, Any]],
) -> None:
    """A plan with micro-batches forms a loss that couples the samples (an MoE's
    load-balancing loss, in-batch negatives) per round of micro-batches, as one process
    with those micro-batches does (docs/guide.md, "Micro-batches"): compared with that
    run, on the rows in the order the rounds take them, not with the whole batch's."""
    for i, got in results.items():
        if not got.get("rounds"):
            continue
        ranks, micro = got["rounds"]
        shown, resolved = planned[i][0], planned[i][2]
        base = got.get("reference") or references[resolved.precision]
        note = (
            f"the reference: one process with microbatches={micro} on the rows in the "
            f"order plan {shown} runs them (the loss couples the samples of a batch and "
            f"is formed per round of micro-batches: the m-th of every rank together)"
        )
        rows = [in_round_order(b, ranks, micro) for b in job.batches]
        rounds = one_process_reference(
            job.source, resolved.precision, rows, job.seed, job.devices, job.threads,
            base["run_dtype"], None, microbatches=micro,
        )  # fmt: skip
        # the same model and dtype as the whole batch's run: its tolerance (float32's
        # measured noise) and its note hold
        rounds.update(
            rtol=base["rtol"], loss_rtol=base["loss_rtol"], note=_joined(base["note"], note)
        )
        got["reference"] = rounds


def _float64_judged_by_its_noise_where_it_differs(
    job: _Job,
    planned: list[tuple],
    results: dict[int, dict[str, Any]],
    references: dict[str, dict[str, Any]],
) -> None:
    """A float64 plan that differs beyond float64's tolerance, on a model that is not
    float64 throughout: the one-process run again with its rows reversed measures the
    model's own noise (Gemma 2's float32 RMSNorms: 2.3e-9 for a same run under dp=2,
    which was called DIFFERENT), and the plan is judged at NOISE_FACTOR times it, at
    most float32's fixed tolerance. A model that computes in float64 throughout
    measures 1e-16 and keeps float64's tolerance. Measured once per reference, and only
    where a plan would be called different."""
    noise: dict[int, float] = {}
    for i, (_shown, _count, resolved, refused) in enumerate(planned):
        got = results.get(i)
        if resolved is None or refused or got is None or "refused" in got:
            continue
        reference = got.get("reference") or references[resolved.precision]
        if reference["dtype"] != torch.float64 or resolved.precision != "fp32":
            continue
        if resolved.num_microbatches > 1 and got.get("rounds"):
            continue  # a coupled loss per round: the rows reversed form other rounds
        if _compare("", 0, got, reference, None).ok:
            continue
        key = id(reference)
        if key not in noise:
            try:
                noise[key] = rows_reversed_noise(reference, job.source, None, job.batches, job.seed)
            except Exception:  # noqa: BLE001 - float64's tolerance stands
                noise[key] = 0.0
        measured = noise[key]
        rtol = min(max(NOISE_FACTOR * measured, reference["rtol"]), tolerance(torch.float32))
        if rtol <= reference["rtol"]:
            continue
        note = (
            f"float64 judged at {NOISE_FACTOR} x its measured noise: the model computes parts "
            f"in lower precision inside (the one-process run with the rows reversed: "
            f"{measured:.1e} relative)"
        )
        got["reference"] = {
            **reference, "rtol": rtol, "loss_rtol": max(rtol, reference["loss_rtol"]),
            "note": _joined(reference["note"], note),
        }  # fmt: skip


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
    report = VerifyReport(
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
    return report if report.ok else replace(report, departs=departure(got, ref, rtol))


def _largest_difference(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> tuple[float, str | None]:
    """The largest relative weight difference and its tensor's name (a NaN is the worst)."""
    diffs = weight_differences(got, ref)
    name = max(
        sorted(diffs), key=lambda k: math.inf if math.isnan(diffs[k]) else diffs[k], default=None
    )
    return (0.0, None) if name is None else (diffs[name], name)


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


def _refuse_inside_workers() -> None:
    # The one-process run here would join the workers' process group instead.
    in_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if in_group or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise MeshfitError(
            "verify starts its own workers and runs the one-process reference here: call "
            "it from a plain Python process, not inside a launched worker"
        )
