"""The context-parallel probe: at the first step, the cut sequence must give the whole
sequence's loss. What meshfit cannot see from outside (attention written by hand with
einsum, positions sliced from a precomputed table, a layer that reads another token
some other way) would otherwise train another run with no word.

On a window of the first row of this rank's share (no gradients, dropout held still,
buffers and the random state restored: coupling/probe.py's `held_still`), the loss of the
window, computed by this rank alone, is compared with the loss the cp ranks compute
together on their chunks of it. When they differ beyond rounding, the first module (in
the order the forward runs them) whose output for this rank's tokens differs is named,
and the plan is refused.

The window is 64 x cp tokens at most (the row's start, else its end where the start
holds no target: left padding): what is checked is how the model reads the sequence
(its attention, its positions), which a short window shows as well as a long one, and
a rank that runs a whole 131,072-token sequence alone, even without gradients, would
hold what cp exists to split (its logits alone: 67 GB in float32 for Llama 3's
vocabulary).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling.probe import held_still
from meshfit.errors import MeshfitError
from meshfit.trees import map_tensors, tensors_in

_ROUNDING = {torch.float64: 1e-10, torch.float32: 1e-4}
WINDOW_PER_RANK = 64  # tokens of the probe's window per cp rank


def check_sequence_split(
    model: nn.Module,
    sequence: Any,
    run_loss: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor | None]],
    inputs: Any,
    targets: Any,
    left_out: Any = None,
) -> None:
    """Refuse (one line, on every rank alike) a model whose loss the sequence cut changes.
    `run_loss(inputs, targets)` is the runner's forward and loss of one micro-batch;
    `left_out`, a context both runs go in (a load-balancing loss as zero: meshfit's own,
    coupling/moe.py)."""
    from meshfit.parallel.context import _sequence_length

    length = _sequence_length(inputs)
    width = min(length, WINDOW_PER_RANK * sequence.cp)
    recorded: dict[str, list[torch.Tensor]] = {}
    seen: dict[str, list[torch.Tensor]] = {}
    difference, dtype = 0.0, None
    with held_still(model), left_out or contextlib.nullcontext():
        for start in dict.fromkeys((0, length - width)):  # the row's start, else its end
            row = (_window(inputs, length, start, width), _window(targets, length, start, width))
            recorded.clear()
            with _outputs_recorded(model, recorded):
                whole = run_loss(*row)
            if _has_targets(whole):
                # the cp group holds the same row: its ranks all come here, or none does
                local_in, local_targets = sequence.local(*row)
                with _outputs_recorded(model, seen), sequence.running():
                    part = run_loss(local_in, local_targets)
                difference, dtype = _difference(whole, part, sequence.group), whole[0].dtype
                break
    # as a share of each rank's rounding, so that every rank takes the same path
    rounding = _ROUNDING.get(dtype, 1e-2) if dtype is not None else 1.0
    verdict = torch.tensor([difference / rounding, difference], dtype=torch.float64)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    if float(verdict[0]) <= 1.0:
        return
    where = _first_departing(recorded, seen, sequence)
    if where is not None:
        kind = type(model.get_submodule(where)).__name__
        where = f"{where.removeprefix('module.')} ({kind})"  # without DDP's wrapper
    raise MeshfitError(
        f"context parallel cannot cut this model's sequences: on a window of the batch's "
        f"first sequence the cut changes the loss by {float(verdict[1]):.1e} (relative)"
        + (f"; the first module whose output departs is {where}" if where else "")
        + ". Its attention must run through F.scaled_dot_product_attention (causal) or "
        "transformers' attention functions, and its positions come from position_ids or "
        "torch.arange(sequence length); train this model without cp"
    )


def _window(tree: Any, length: int, start: int, width: int) -> Any:
    """The first row of `tree`, its sequence dimension (`length` long) cut to
    [start, start + width)."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        if not t.ndim:
            return t
        row = t[:1]
        return row[:, start : start + width] if row.ndim >= 2 and row.shape[1] == length else row

    return map_tensors(tree, keep)


def _has_targets(result: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
    loss, count = result
    if count is not None and float(count) == 0:
        return False
    return bool(torch.isfinite(loss.detach()).all())


def _difference(
    whole: tuple[torch.Tensor, torch.Tensor | None],
    part: tuple[torch.Tensor, torch.Tensor | None],
    group: dist.ProcessGroup,
) -> float:
    """|the cp ranks' combined loss - the whole sequence's| / |the whole's|."""
    (loss, count), (mine, my_count) = whole, part
    if count is None:
        total = mine.detach().double().reshape(1).clone()
        dist.all_reduce(total, group=group)
        combined = total / dist.get_world_size(group)
        reference = loss.detach().double()
    else:
        pair = torch.stack([mine.detach().double(), my_count.double()])
        dist.all_reduce(pair, group=group)
        combined = pair[0] / pair[1].clamp_min(1)
        reference = loss.detach().double() / count.double().clamp_min(1)
    return float((combined - reference).abs().max() / reference.abs().clamp_min(1e-12))


class _outputs_recorded:
    """Each module's first floating output of the forward, in call order."""

    def __init__(self, model: nn.Module, into: dict[str, list[torch.Tensor]]) -> None:
        self.model, self.into = model, into
        self.names = {id(m): n for n, m in model.named_modules()}
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        def hook(module: nn.Module, _args: Any, output: Any) -> None:
            found = [t for t in tensors_in(output) if t.is_floating_point() and t.ndim >= 2]
            if found:
                name = self.names.get(id(module), "")
                self.into.setdefault(name, []).append(found[0].detach())

        self.handles = [m.register_forward_hook(hook) for m in self.model.modules()]

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()


def _first_departing(
    whole: dict[str, list[torch.Tensor]], cut: dict[str, list[torch.Tensor]], sequence: Any
) -> str | None:
    """The first module (in call order of the whole forward) whose output on this rank's
    tokens differs between the whole sequence and the cut one."""
    positions = sequence.state.positions if sequence.state is not None else None
    if positions is None:
        return None
    length = sequence.state.length
    for name, outputs in whole.items():
        if not name or name not in cut:
            continue
        for full, part in zip(outputs, cut[name], strict=False):
            if full.shape[1] != length or part.shape[1] != positions.shape[0]:
                continue
            mine = full.index_select(1, positions.to(full.device))
            if mine.shape != part.shape:
                continue
            scale = mine.double().norm().clamp_min(1e-30)
            if float((mine.double() - part.double()).norm() / scale) > 1e-6:
                return name
    return None
