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

Under pipeline parallel no rank holds the whole model: the window goes through the
stages, whole and cut, each stage's rank sending both results on, and the last stage
compares the losses (check_staged_sequence_split).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling.probe import held_still
from meshfit.errors import MeshfitError
from meshfit.losses import split_loss
from meshfit.trees import map_tensors, tensors_in

# How far the cut may move the window's loss, relative. float64: models whose layers
# compute in float32 inside (transformers' Gemma 2 RMSNorm casts to float32 and back)
# round the cut's reordered key sums there: Gemma 2 at 1.7e-10 (measured, cp=2); the
# faults the probe is for show at 1e-5 and above (measured: attention written by hand
# 2.0e-3, padding read 1.9e-3, a mean over masked tokens 2.6e-3, ALiBi from the mask 8e-6)
_ROUNDING = {torch.float64: 1e-8, torch.float32: 1e-4}
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
    found: list[_Found] = []
    with held_still(model), left_out or contextlib.nullcontext():
        for row in _windows(sequence, inputs, targets):
            recorded: dict[str, list[torch.Tensor]] = {}
            seen: dict[str, list[torch.Tensor]] = {}
            with _outputs_recorded(model, recorded):
                whole = run_loss(*row)
            local_in, local_targets = sequence.local(*row)
            with _outputs_recorded(model, seen), sequence.running():
                part = run_loss(local_in, local_targets)
            difference = _difference(whole, part, sequence.group)
            if _has_targets(whole):
                where = _named(model, _first_departing(recorded, seen, sequence))
                found.append(_Found(difference, whole[0].dtype, where, _masked_mean(whole, row)))
    _verdict(found[0] if found else _Found())


def check_staged_sequence_split(
    runner: Any, inputs: Any, targets: Any, left_out: Any = None
) -> None:
    """check_sequence_split under pipeline parallel, where no rank holds the whole model:
    the window goes through the stages twice, whole and cut (each stage sends both
    results to the next stage's rank), the last stage compares the two losses, and each
    stage names the first of its modules whose output for its tokens departs."""
    sequence, model = runner.sequence, runner.model
    found: list[_Found] = []
    departures: list[str] = []
    with held_still(model), left_out or contextlib.nullcontext():
        for row in _windows(sequence, inputs, targets):
            local = sequence.local(*row)
            losses, where = _through_the_stages(runner, row, local)
            if where is not None:
                departures.append(_named(model, where))
            if losses is not None:  # the last stage
                whole, part = losses
                difference = _difference(whole, part, sequence.group)
                if _has_targets(whole):
                    found.append(_Found(difference, whole[0].dtype, None, _masked_mean(whole, row)))
    verdict = found[0] if found else _Found()
    verdict.where = departures[0] if departures else None
    _verdict(verdict)


def _windows(sequence: Any, inputs: Any, targets: Any) -> list[tuple[Any, Any]]:
    """The windows of the first row the probe tries, in order: its start, else its end
    (where left padding leaves the start without targets). Every rank runs every window,
    whatever its own row holds: the ranks beside it in data parallel hold other rows, and
    FSDP2's gathers and expert parallel's all-to-alls need them all to run as many
    forwards (one rank that stopped after the first window hung its shard's peers)."""
    from meshfit.parallel.context import _sequence_length

    length = _sequence_length(inputs)
    width = min(length, WINDOW_PER_RANK * sequence.cp)
    return [
        (_window(inputs, length, start, width), _window(targets, length, start, width))
        for start in dict.fromkeys((0, length - width))
    ]


@dataclasses.dataclass
class _Found:
    """What one rank's probe found on the first window with targets."""

    difference: float = 0.0  # relative, between the whole window's loss and the cut's
    dtype: torch.dtype | None = None  # the loss's
    where: str | None = None  # the first module whose output departs, "name (Kind)"
    masked_mean: bool = False  # loss_fn returned a mean, and some targets are ignored


def _verdict(found: _Found) -> None:
    """The same decision on every rank: the largest difference of any rank, as a share of
    its rounding; the first departing module any rank found, named. With no module
    departing, the loss itself is what the cut changes: a mean over masked tokens (each
    rank's mean weighs its own count) is named with its fix."""
    rounding = _ROUNDING.get(found.dtype, 1e-2) if found.dtype is not None else 1.0
    verdict = torch.tensor(
        [found.difference / rounding, found.difference, float(found.masked_mean)],
        dtype=torch.float64,
    )
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    if float(verdict[0]) <= 1.0:
        return
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, found.where)
    where = next((n for n in names if n is not None), None)
    changed = (
        f"on a window of the batch's first sequence the cut changes the loss by "
        f"{float(verdict[1]):.1e} (relative)"
    )
    if where is None and float(verdict[2]):
        raise MeshfitError(
            f"context parallel cannot cut this loss: {changed} while every module's output "
            f"agrees: loss_fn returns a mean over each rank's tokens, and with ignored "
            f"(-100) targets the ranks hold different counts of them; return a pair "
            f"(loss_sum, count), e.g. loss_fn=mf.losses.cross_entropy(ignore_index=-100) "
            f"(shift=True for labels that are not yet shifted)"
        )
    if where is None:
        raise MeshfitError(
            f"context parallel cannot cut this loss: {changed} while every module's output "
            f"agrees, so loss_fn reads the sequence as a whole (it shifts the targets "
            f"itself, or reads positions); use mf.losses.cross_entropy(shift=True), which "
            f"meshfit shifts before the cut, or return a (sum, count) pair over tokens; "
            f"else train without cp"
        )
    raise MeshfitError(
        f"context parallel cannot cut this model's sequences: {changed}; the first module "
        f"whose output departs is {where}. Its attention must run through "
        f"F.scaled_dot_product_attention (causal) or transformers' attention functions, "
        f"and its positions come from position_ids or torch.arange(sequence length); "
        f"train this model without cp"
    )


def _named(model: nn.Module, where: str | None) -> str | None:
    """A module's name as the user knows it (without DDP's wrapper) and its class."""
    if where is None:
        return None
    return f"{where.removeprefix('module.')} ({type(model.get_submodule(where)).__name__})"


def _masked_mean(whole: tuple[torch.Tensor, torch.Tensor | None], row: tuple[Any, Any]) -> bool:
    """Whether the loss is a mean (no count) over targets some of which are ignored
    (-100: padding, prompts), in the targets or in the inputs' labels."""
    if whole[1] is not None:
        return False
    inputs, targets = row
    labels = [targets, inputs.get("labels") if isinstance(inputs, Mapping) else None]
    return any(
        isinstance(t, torch.Tensor) and not t.is_floating_point() and bool((t == -100).any())
        for t in labels
    )


def _through_the_stages(
    runner: Any, row: tuple[Any, Any], local: tuple[Any, Any]
) -> tuple[tuple | None, str | None]:
    """One window through this rank's stages, whole (`row`) and cut (`local`), in stage
    order: (the whole and cut losses on the last stage, else None; the first module of
    this rank's stages whose output departs)."""
    sequence, group = runner.sequence, runner.group
    stages = {s.stage_index: s for s in runner.stages}
    anyone = runner.stages[0]
    owner, count = anyone.stage_index_to_group_rank, anyone.num_stages
    me, device = dist.get_rank(group), anyone.device
    whole = cut = losses = where = None
    for index in sorted(stages):
        if index > 0 and owner[index - 1] != me:
            whole, cut = _received(owner[index - 1], group, device)
        module = stages[index].submod
        first = index == 0
        recorded: dict[str, list[torch.Tensor]] = {}
        seen: dict[str, list[torch.Tensor]] = {}
        with _outputs_recorded(model := runner.model, recorded):
            whole = module(*_stage_args(first, row[0], whole), model_inputs=row[0])
        with _outputs_recorded(model, seen), sequence.running():
            cut = module(*_stage_args(first, local[0], cut), model_inputs=local[0])
            if index == count - 1:
                loss_fn = runner.stage_loss.loss_fn
                form = getattr(module, "module", module).output_form
                part = split_loss(loss_fn(form.restore(cut), local[1]))
        if index == count - 1:
            losses = (split_loss(loss_fn(form.restore(whole), row[1])), part)
        where = where or _first_departing(recorded, seen, sequence)
        if index < count - 1 and owner[index + 1] != me:
            _send((whole, cut), owner[index + 1], group)
    return losses, where


def _stage_args(first: bool, inputs: Any, received: Any) -> tuple:
    """A stage's positional input: the batch's first tensor on the first stage (as the
    pipeline runner passes it), else what the previous stage sent."""
    if first:
        return (tensors_in(inputs)[0],)
    return tuple(received) if isinstance(received, (tuple, list)) else (received,)


def _send(value: Any, to: int, group: dist.ProcessGroup) -> None:
    value = map_tensors(value, lambda t: t.detach().cpu())  # a window: a few KB
    dist.send_object_list([value], dst=dist.get_global_rank(group, to), group=group)


def _received(sender: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    # recv_object_list unpickles: the bytes come from the previous stage's rank of this
    # run's process group, which joined through meshfit's signed rendezvous (the trust
    # every collective of the run rests on; the state gathers use all_gather_object too)
    box: list[Any] = [None]
    dist.recv_object_list(box, src=dist.get_global_rank(group, sender), group=group)
    return map_tensors(box[0], lambda t: t.to(device))


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
    # padding's outputs are not compared: a padding query before a row's first real token
    # has no key to read, and cp has it read itself (attention.py) where transformers'
    # masks do otherwise; no real token reads what it computes
    real = sequence.state.real
    kept = None if real is None else real[0].to(positions.device)[positions].nonzero()[:, 0]
    for name, outputs in whole.items():
        if not name or name not in cut:
            continue
        for full, part in zip(outputs, cut[name], strict=False):
            if full.shape[1] != length or part.shape[1] != positions.shape[0]:
                continue
            mine = full.index_select(1, positions.to(full.device))
            if mine.shape != part.shape:
                continue
            if kept is not None:
                mine, part = (
                    mine.index_select(1, kept.to(mine.device)),
                    part.index_select(1, kept.to(part.device)),
                )
            scale = mine.double().norm().clamp_min(1e-30)
            if float((mine.double() - part.double()).norm() / scale) > 1e-6:
                return name
    return None
