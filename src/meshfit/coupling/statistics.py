"""Buffers a training forward updates from the samples it sees: asked at the first
training step of a plan that splits the batch, beside the coupling probe.

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

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling.probe import (
    _LOW_PRECISION,
    ROUNDING,
    OpenScope,
    Replay,
    RunLoss,
    held_still,
)
from meshfit.trees import batch_rows, slice_rows


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
) -> Statistics:
    """The buffers `model`'s training forward updates from its batch (module docstring),
    agreed over every rank (each takes the same path)."""
    n = batch_rows(inputs)
    samples = 4 if n >= 4 else 2 if n >= 2 else 0
    names: list[str] = []
    read = False
    if samples:
        try:
            names, read = _statistics(
                model, run_loss, open_scope, inputs, targets, samples, low_precision
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
) -> tuple[list[str], bool]:
    x, y = slice_rows(inputs, 0, samples), slice_rows(targets, 0, samples)
    half = samples // 2
    replay = Replay(samples)  # what meshfit gathers, each half sees the whole's (probe.py)
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
            replay.half(start, stop)
            loss_of(start, stop, 2, replay)
            now = buffers.current()
            names += [n for n in changed if n not in names and not _same(now[n], after[n])]
        if not names:
            return [], False
        buffers.restore({name: after[name] for name in names})
        again = loss_of(0, samples, 1, None)
    limit = _LOW_PRECISION if low_precision else ROUNDING.get(together.dtype, _LOW_PRECISION)
    moved = abs(float(again) - float(together)) / max(abs(float(together)), 1e-30)
    return names, moved > limit


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or within rounding for floating point (a mean over other kernel blockings);
    equal infinities and NaNs are the same (a mask of -inf kept in a buffer)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    limit = ROUNDING.get(a.dtype, _LOW_PRECISION) * max(scale, 1e-30)
    return bool(torch.allclose(a, b, rtol=0.0, atol=limit, equal_nan=True))
