"""The two runs `mf.verify` compares, trained the same way (`train`): a plan's, on the
worker processes, and the one-process reference in this process (`reference`), in
float64 where the model trains in it, else in its own dtype with a note that says why; a
float32 reference judged against float32's noise measured on the same model and batch.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from meshfit.options import engine_options
from meshfit.plan import Plan
from meshfit.prepare import prepare
from meshfit.trees import map_tensors
from meshfit.verification.locate import FirstStepTrace, gathered, replica_gap
from meshfit.verification.report import loss_tolerance, tolerance, weight_differences
from meshfit.verification.targets import _Objects, _Recipe, _Target

# Options that only say how tp / pp split the model: the one-process reference drops
# them (parallelize refuses them without their form).
FORM_OPTIONS = ("tp_plan", "pp_split")


def train(
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
    options = engine_options("verify does not take", recipe.loss_fn, recipe.options)
    if reference:
        options = replace(options, **dict.fromkeys(FORM_OPTIONS))
    model = recipe.model
    if dtype is not None:
        model = model.to(dtype)
        batches = [
            map_tensors(b, lambda t: t.to(dtype) if t.is_floating_point() else t) for b in batches
        ]
    engine = prepare(model, plan, options).engine(model)
    # the forms built first (as the first step would), so the tracer's hooks see the
    # step alone, not tp's trace or pp's cost measurement of the model
    engine._build_on(engine.split_batch(batches[0])[0])
    # where a different run departs (locate.py); a compiled step's modules unhooked
    tracer = FirstStepTrace(engine.user_model, outputs=not options.compile)
    tracer.start()
    try:
        losses = [float(engine.step(batches[0]))]
    finally:
        trace = tracer.finish()
    losses += [float(engine.step(batch)) for batch in batches[1:]]
    gap, name = (0.0, None) if reference else replica_gap(engine)
    coupled = engine.coupling.verdict is not None and bool(engine.coupling.verdict.met)
    micro = engine.plan.num_microbatches
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "replicas": (gap, name),
        "trace": gathered(trace),
        # a coupled loss formed per round of micro-batches: (ranks, micro-batches)
        "rounds": (engine.topology.dp_size, micro) if coupled and micro > 1 else None,
    }


def one_process_reference(
    source: _Objects | _Target,
    precision: str,
    batches: list[Any],
    seed: int,
    devices: str | Sequence[int] | None,
    threads: int | None,
    dtype: torch.dtype | None,
    note: str | None = None,
    microbatches: int = 1,
) -> dict[str, Any]:
    """The one-process run (with `microbatches`, where a plan forms a coupled loss per
    round of them), in this process; on a GPU machine whose workers are told to use the
    CPU (devices="cpu"), in one worker process instead, so that both runs use the same
    kind of device (this process would take the GPU)."""
    from meshfit.launch import launch, plan_workers

    here = "cuda" if torch.cuda.is_available() else "cpu"
    args = (source, precision, batches, seed, dtype, note, microbatches)
    if plan_workers(1, devices, threads).device_kind != here:
        return launch(_reference_run, nproc=1, args=args, devices=devices, threads=threads)
    return _reference_run(*args)


def _reference_run(
    source: _Objects | _Target,
    precision: str,
    batches: list[Any],
    seed: int,
    dtype: torch.dtype | None = None,
    note: str | None = None,
    microbatches: int = 1,
) -> dict[str, Any]:
    """The one-process run, in `dtype` when the model runs in it (else in its own, with
    a note that says why; `note`: what the caller adds); "run_dtype" is the one the
    plans' runs must use."""
    plan = None
    if precision != "fp32" or microbatches > 1:
        plan = Plan(precision=precision, microbatches=microbatches if microbatches > 1 else None)
    if dtype is not None:
        try:
            return _reference_in(source.recipe(seed), plan, batches, dtype, note)
        except Exception as failure:  # noqa: BLE001 - compared in its own dtype instead
            # meshfit's first-step explanation wraps the model's own error: name that one
            error = failure.__cause__ or failure
            note = _joined(
                note,
                f"compared in the model's own dtype: it does not train in "
                f"{str(dtype).removeprefix('torch.')} ({type(error).__name__}: "
                f"{(str(error).splitlines() or [''])[0]})",
            )
    reference = _reference_in(source.recipe(seed), plan, batches, None, note)
    # (with micro-batches the caller carries the whole batch's judgement over: the rows
    # reversed would form a coupled loss over other samples per micro-batch)
    if reference["dtype"] == torch.float32 and precision == "fp32" and microbatches == 1:
        _judge_by_measured_noise(reference, source, plan, batches, seed)
    return reference


# A plan's float32 run differs from one process's by reassociation, as the one-process
# run does from itself with its batch's rows in another order: measured on the zoo's
# float32 models (Mixtral, Qwen3-MoE; 3 SGD steps), the rows reversed moved the weights
# by 1.5e-8 to 2.4e-8 relative, and dp=2 / tp=2 by 1.2e-8 to 2.5e-8. A run is the same
# within NOISE_FACTOR times the measured distance (a plan reassociates other sums than a
# permutation does), at least _AMPLIFICATION roundoffs (1.0e-5: a distance measured at 0
# says little) and at most the fixed tolerance. The load-balancing loss formed per rank
# (the silent bug of issue 43) moved the weights by 1.7e-4 and 1.9e-4.
NOISE_FACTOR = 100


def _judge_by_measured_noise(
    reference: dict[str, Any],
    source: _Objects | _Target,
    plan: Plan | None,
    batches: list[Any],
    seed: int,
) -> None:
    """A float32 comparison judged against float32's noise on this model and batch: the
    one-process run again with every batch's rows reversed (the same samples, its sums in
    another order), whose distance from the first is the floor a same run stays within
    (fixed at 1e-3, float32 let through a gradient wrongly formed on every rank)."""
    from meshfit.verification.report import _AMPLIFICATION, _ROUNDOFF

    try:
        noise = rows_reversed_noise(reference, source, plan, batches, seed)
    except Exception:  # noqa: BLE001 - the fixed tolerance stands, and the note says why
        reference["note"] = _joined(
            reference["note"], "float32 judged at its fixed tolerance (the rows reversed failed)"
        )
        return
    floor = _AMPLIFICATION * _ROUNDOFF[torch.float32]
    rtol = min(reference["rtol"], max(NOISE_FACTOR * noise, floor))
    reference["rtol"] = reference["loss_rtol"] = rtol
    reference["note"] = _joined(
        reference["note"],
        f"float32 judged at {NOISE_FACTOR} x its measured noise on this model and batch "
        f"(the one-process run with the rows reversed: {noise:.1e} relative), at least "
        f"{floor:.1e}",
    )


def rows_reversed_noise(
    reference: dict[str, Any],
    source: _Objects | _Target,
    plan: Plan | None,
    batches: list[Any],
    seed: int,
) -> float:
    """How far the one-process run (`reference`, under `plan`) moves with its batch's
    rows reversed (the same samples, its sums in another order): float32's noise; in
    float64 about 1e-16 for a model that computes in float64 throughout, far more for one
    whose layers compute in float32 inside (transformers' Gemma 2 RMSNorm casts its
    weight and input to float32: 1e-8)."""
    again = train(
        source.recipe(seed), plan, [_reversed_rows(b) for b in batches], True,
        dtype=reference["run_dtype"],
    )  # fmt: skip
    losses = [
        abs(a - b) / abs(b) if b else abs(a - b)
        for a, b in zip(again["losses"], reference["losses"], strict=True)
    ]
    weights = weight_differences(again["state"], reference["state"]).values()
    return max([*losses, *weights, 0.0])


def _reversed_rows(batch: Any) -> Any:
    """The batch with its samples in reverse order: every tensor whose first dimension is
    the batch's."""
    return _rows(batch, lambda size: torch.arange(size - 1, -1, -1))


def in_round_order(batch: Any, ranks: int, microbatches: int) -> Any:
    """The batch's samples in the order a plan's rounds of micro-batches run them: round
    m holds the m-th micro-batch of every rank, rank after rank (coupling/scope.py). One
    process with `microbatches` micro-batches on these rows forms a coupled loss (an MoE's
    load-balancing loss, in-batch negatives) over the same samples as the plan does."""

    def order(size: int) -> torch.Tensor:
        share, micro = size // ranks, size // ranks // microbatches
        rows = [
            r * share + m * micro + i
            for m in range(microbatches)
            for r in range(ranks)
            for i in range(micro)
        ]
        return torch.tensor(rows)

    return _rows(batch, order)


def _rows(batch: Any, order: Any) -> Any:
    """Every tensor of `batch` whose first dimension is the batch's, its rows taken in
    `order(size)`."""
    from meshfit.trees import tensors_in

    found = tensors_in(batch)
    size = found[0].shape[0] if found and found[0].ndim else 0
    index = order(size)
    return map_tensors(
        batch, lambda t: t[index.to(t.device)] if t.ndim and t.shape[0] == size else t
    )


def _joined(note: str | None, more: str) -> str:
    return more if note is None else f"{note}; {more}"


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
    run = train(recipe, plan, batches, reference=True, dtype=run_dtype)
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
