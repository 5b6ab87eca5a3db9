"""Buffers a training forward updates from the samples it sees: asked at the first
training step of a plan that splits the batch, beside the coupling probe; under pp, of
the model's forward alone on the whole model before the cut (`before_pipeline_cut`).

Some models keep statistics of their batches in buffers, updated in every training
forward: a VQ-VAE's codebook averages (cluster sizes, summed vectors, the codebook they
give), I-BERT's activation ranges (QuantAct's `x_min`/`x_max`), InstanceNorm's running
statistics with `track_running_stats=True`. Under a plan that splits the batch each rank
(and micro-batch) updates them from its own share, where one process updates them from
the whole batch; DDP then broadcasts rank 0's before every forward, FSDP leaves each
rank its own. Nothing fails: if the forward reads them (the codebook), the run trains
other numbers than one process, silently; if not (I-BERT with `quant_mode=False`),
only the saved buffers and what evaluation reads differ.

meshfit makes BatchNorm's statistics global (parallel/batchnorm.py) but cannot know how
another update combines (a mean, a minimum, a count), so it asks: from the same buffers
and random state, one pass over the first samples together and one over each half
(what two ranks would see); a buffer that ends other after a half than after the whole
is a statistic of the batch. Then, with only those buffers at their updated values, the
pass over the samples together again: a loss that moves means the forward reads them.
A statistic the forward reads refuses the plan (`sync_batchnorm=False` opts out: each
rank keeps its own, as for BatchNorm); one it does not read is said in a start-up line.
BatchNorm's own running statistics are held still here (the probe runs BatchNorm in
evaluation mode) and a counter (`num_batches_tracked`, a step count) ends the same
after a half, so neither is named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling.halves import rounding
from meshfit.coupling.probe import (
    OpenScope,
    Replay,
    RunLoss,
    _fingerprint,
    held_still,
    probe_samples,
)
from meshfit.errors import MeshfitError
from meshfit.trees import call_model, slice_rows, tensors_in

# libraries whose models bring their own code (not the user's to edit)
LIBRARIES = {"transformers", "diffusers", "timm", "torchvision", "peft"}


@dataclass
class Statistics:
    """The buffers whose training update depends on the samples a forward sees (this
    rank's names), whether any rank found one, and whether the forward reads them."""

    names: list[str] = field(default_factory=list)
    found: bool = False
    read: bool = False


def batch_statistics(
    model: nn.Module,
    run_loss: RunLoss,
    open_scope: OpenScope,
    inputs: Any,
    targets: Any,
    *,
    low_precision: bool,
    world: dist.ProcessGroup | None,
    gathered: bool = True,
) -> Statistics:
    """The buffers `model`'s training forward updates from its batch (module docstring),
    agreed over every rank (each takes the same path). `gathered`: each half's pass
    sees what meshfit gathers over the whole (mf.gather_batch crosses ranks); False
    where the parts are micro-batches, run one after another (nothing crosses them)."""
    samples = probe_samples(inputs)
    names: list[str] = []
    read = False
    if samples:
        try:
            names, read = _statistics(
                model, run_loss, open_scope, inputs, targets, samples, low_precision, gathered
            )
        except Exception:  # noqa: BLE001 - nothing to tell: the coupling probe, run first, ran
            names, read = [], False
    agreed = torch.tensor([float(bool(names)), float(read)])
    if world is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=world)
    return Statistics(names=names, found=bool(agreed[0] > 0), read=bool(agreed[1] > 0))


def _statistics(
    model: nn.Module,
    run_loss: RunLoss,
    open_scope: OpenScope,
    inputs: Any,
    targets: Any,
    samples: int,
    low_precision: bool,
    gathered: bool,
) -> tuple[list[str], bool]:
    x, y = slice_rows(inputs, 0, samples), slice_rows(targets, 0, samples)
    half = samples // 2
    # what meshfit gathers, each half sees the whole's (probe.py's Replay)
    replay = Replay(samples) if gathered else None
    with held_still(model) as buffers:
        drawn = torch.get_rng_state()

        def loss_of(start: int, stop: int, parts: int, replaying: Replay | None) -> torch.Tensor:
            torch.set_rng_state(drawn)
            rows = stop - start
            with open_scope(replay=replaying, rows=rows, parts=parts, targets=y, products=False):
                loss = run_loss(slice_rows(x, start, stop), slice_rows(y, start, stop))
            return loss[0].detach()

        together = loss_of(0, samples, 1, replay)
        after = buffers.current()
        saved = buffers.saved()
        changed = [name for name in after if not _same(after[name], saved[name])]
        if not changed:
            return [], False
        names = []
        for start, stop in ((0, half), (half, samples)):
            buffers.restore()
            if replay is not None:
                replay.half(start, stop)
            loss_of(start, stop, 2, replay)
            now = buffers.current()
            names += [n for n in changed if n not in names and not _same(now[n], after[n])]
        if not names:
            return [], False
        buffers.restore({name: after[name] for name in names})
        again = loss_of(0, samples, 1, None)
    limit = rounding(together.dtype, low_precision)
    moved = abs(float(again) - float(together)) / max(abs(float(together)), 1e-30)
    return names, moved > limit


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or within rounding for floating point (a mean over other kernel blockings);
    equal infinities and NaNs are the same (a mask of -inf kept in a buffer). A buffer
    tensor parallel split (a DTensor) is compared whole: its shards compared one by one,
    one rank found its shard unchanged and returned while its peer went on to a
    collective (measured: a Llama on meta under pp=2,tp=2 hung here). Every tp peer
    gathers the same buffers in the same order (the same names, the same answers)."""
    from torch.distributed.tensor import DTensor

    a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    limit = rounding(a.dtype) * max(scale, 1e-30)
    return bool(torch.allclose(a, b, rtol=0.0, atol=limit, equal_nan=True))


def forward_only(model: nn.Module) -> RunLoss:
    """A probe pass without a loss (pipeline parallel asks before its cut, where no loss
    runs on the whole model): a fixed random projection of the output's first floating
    tensor stands for it, so a buffer the forward reads moves it."""

    def run(inputs: Any, _targets: Any) -> tuple[torch.Tensor, None]:
        outputs = [t for t in tensors_in(call_model(model, inputs)) if t.is_floating_point()]
        if not outputs:
            return torch.zeros((), dtype=torch.float64), None
        projected = _fingerprint(outputs[0].detach(), 0)[1]  # the probe's own projection
        return torch.tensor(projected, dtype=torch.float64), None

    return run


def parts_named(dp: int, microbatches: int) -> str:
    """`2 data-parallel ranks x 4 micro-batches`: what a plan splits the batch over."""
    parts = [f"{dp} data-parallel ranks"] if dp > 1 else []
    parts += [f"{microbatches} micro-batches"] if microbatches > 1 else []
    return " x ".join(parts)


def _named(statistics: Statistics) -> str:
    names = statistics.names
    if not names:  # another rank found them
        return "a buffer is"
    more = ", ".join(names[1:3]) + (", ..." if names[3:] else "")
    more = f" (and {len(names) - 1} more: {more})" if names[1:] else ""
    return f"buffer {names[0]!r}{more} is"


def refusal_line(
    statistics: Statistics, model: nn.Module, plan: Any, parts: str, gathered: bool
) -> str:
    """The one line refusing a plan whose parts would each update a buffer the forward
    reads, with the fixes (an edit only where the code is the user's; mf.gather_batch
    only where the parts are ranks: `gathered`)."""
    whole = "a plan that keeps the batch whole (tp=N, or pp=N,microbatches=1,schedule=gpipe)"
    if all(getattr(plan, degree, 1) == 1 for degree in ("dp", "fsdp", "pp")):
        whole = f"microbatches=1 (or {whole})"  # micro-batches alone split it: the one fix
    own = "sync_batchnorm=False to let each rank keep its own (not the one-process run)"
    names = statistics.names
    owner = model.get_submodule(names[0].rpartition(".")[0]) if names else model
    top = type(owner).__module__.split(".")[0]
    fix = f"Use {whole}, or pass {own}"
    if top in LIBRARIES:
        fix = (
            f"It is {top}'s code ({type(owner).__name__}), which meshfit does not change: "
            f"use {whole}, or pass {own}"
        )
    elif gathered:
        fix = (
            f"Compute the update from mf.gather_batch(x) (the global batch's rows), use "
            f"{whole}, or pass {own}"
        )
    return (
        f"{_named(statistics)} updated by the model's training forward from the samples it "
        f"sees, and the forward reads it: from the same start it ends other after half of "
        f"the first batch's samples than after them together. Plan {plan} splits the batch "
        f"over {parts}, and each would update it from its own share where one process "
        f"updates it from the whole batch, and train another run than one process. meshfit "
        f"makes BatchNorm's statistics global, not this one (it cannot tell how its updates "
        f"combine). " + fix
    )


def note_line(statistics: Statistics, plan: Any, parts: str) -> str | None:
    """The start-up line on buffers updated from each part's share (None: none)."""
    if not statistics.found:
        return None
    if statistics.read:  # trained on under sync_batchnorm=False
        return (
            f"{_named(statistics)} updated by the training forward from the samples it "
            f"sees, and read by it; plan {plan} splits the batch over {parts} and "
            f"sync_batchnorm=False lets each keep its own, so this is not the one-process run"
        )
    return (
        f"{_named(statistics)} updated by the training forward from the samples it sees "
        f"(the loss does not read it): plan {plan} splits the batch over {parts}, each "
        f"updating it from its own share, so its values (saved, and read by evaluation) "
        f"will differ from one process's"
    )


def before_pipeline_cut(
    model: nn.Module,
    inputs: Any,
    *,
    plan: Any,
    parts: str,
    own_statistics: bool,
    low_precision: bool,
    world: dist.ProcessGroup | None,
) -> str | None:
    """Pipeline parallel's question, asked on the whole model before its cut (the probe
    cannot run under a pipeline schedule, whose stages run whole micro-batches): the
    model's forward alone on the example batch. Refuses a statistic the forward reads;
    returns the start-up line on one it does not (None: none)."""
    found = read_by_forward(model, inputs, low_precision=low_precision, world=world)
    if found.read and not own_statistics:
        raise MeshfitError(refusal_line(found, model, plan, parts, gathered=False))
    return note_line(found, plan, parts)


def read_by_forward(
    model: nn.Module,
    inputs: Any,
    *,
    low_precision: bool = False,
    world: dist.ProcessGroup | None = None,
) -> Statistics:
    """The question asked of the model's forward alone (no loss, nothing gathered: the
    parts are micro-batches, or unknown to the planner, which asks it too), in training
    mode whatever mode the model is in (`from_pretrained` returns it in evaluation mode,
    whose forward updates no buffer; training steps put it in training mode)."""
    with in_training(model):
        return batch_statistics(
            model,
            forward_only(model),
            _no_scope,
            inputs,
            inputs,
            low_precision=low_precision,
            world=world,
            gathered=False,
        )


@contextlib.contextmanager
def in_training(model: nn.Module) -> Iterator[None]:
    """`model` in training mode inside; every module's own mode back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def splitting_refused(model: nn.Module, inputs: Any) -> str | None:
    """The planner's reason to drop every plan that splits the batch (ranks or
    micro-batches): a statistic of the batch the forward reads; None: none."""
    found = read_by_forward(model, inputs)
    if not found.read:
        return None
    return (
        f"buffer {found.names[0]!r} is updated by the training forward from its batch and "
        f"read by it: a plan that splits the batch (ranks or micro-batches) would train "
        f"another run"
    )


def _no_scope(**_: Any) -> contextlib.AbstractContextManager:
    """No coupling scope: before the cut nothing is gathered."""
    return contextlib.nullcontext()
