"""The context-parallel probe: at the first step, the cut sequence must give the whole
sequence's loss. What meshfit cannot see from outside (attention written by hand with
einsum, positions sliced from a precomputed table, a layer that reads another token
some other way) would otherwise train another run with no word.

On a window of the first row of this rank's share (no gradients, dropout held still,
buffers and the random state restored: coupling/probe.py's `held_still`), the loss of the
window, computed by this rank alone, is compared with the loss the cp ranks compute
together on their chunks of it, and each module's output for this rank's tokens with the
same tokens' output of the whole window. When the loss differs beyond rounding, or a
module's output beyond its dtype's share (_DEPARTS: at initial weights a layer the cut
breaks can move the loss by less than float32 rounds), the first module (in the order
the forward runs them) whose output differs is named, and the plan is refused.

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

from meshfit.coupling.halves import IGNORED
from meshfit.coupling.probe import held_still
from meshfit.errors import MeshfitError
from meshfit.losses import split_loss
from meshfit.parallel.context.statistics import TokenStatistics, TokenStatisticsSeen
from meshfit.runtime.batch_errors import collective_failed
from meshfit.trees import map_tensors, slice_rows, tensors_in

# How far the cut may move the window's loss, relative. float64: models whose layers
# compute in float32 inside (transformers' Gemma 2 RMSNorm casts to float32 and back)
# round the cut's reordered key sums there: Gemma 2 at 1.7e-10 (measured, cp=2); the
# faults the probe is for show at 1e-5 and above (measured: attention written by hand
# 2.0e-3, padding read 1.9e-3, a mean over masked tokens 2.6e-3, ALiBi from the mask 8e-6)
_ROUNDING = {torch.float64: 1e-8, torch.float32: 1e-4}
# How far the cut may move a module's output for this rank's tokens (the norm of the
# difference over the norm's), by the output's dtype. The loss alone misses what a model
# at its initial weights barely passes on: a convolution over tokens or a state-space or
# linear-attention scan that crosses the cut moved its layer's output by 0.13-0.60 while
# the loss moved 3e-8 to 8e-5 in float32, under _ROUNDING (LFM2, Jamba, Falcon-H1, Bamba,
# Qwen3-Next: each trained another run with no word). Measured on 25 transformers
# families that cut right (cp=2, their initial weights): 1.6e-7 at most in float32, 0 in
# bfloat16; 8 layers of width 256 on 256 tokens 1.1e-6 (Llama), 2.6e-3 under
# autocast to bfloat16 (Gemma 2), where every module is judged by _DEPARTS_HALF; the
# layers the cut breaks, at that size under autocast: 0.15-0.58.
_DEPARTS = {torch.float64: 1e-4, torch.float32: 1e-3}
_DEPARTS_HALF = 5e-2  # bfloat16, float16
# A departure named where the loss is what moved, as a share of _DEPARTS: 1e-6 in float64
# (as before), 1e-5 in float32, above a right cut's measured 1.1e-6 (a mean over masked
# tokens is then named as the loss, not as the module rounding moved)
_NAMED = 1e-2
WINDOW_PER_RANK = 64  # tokens of the probe's window per cp rank


def check_sequence_split(
    model: nn.Module,
    sequence: Any,
    run_loss: Callable[[Any, Any], tuple[torch.Tensor, torch.Tensor | None]],
    inputs: Any,
    targets: Any,
    left_out: Any = None,
) -> TokenStatistics:
    """Refuse (one line, on every rank alike) a model whose loss the sequence cut changes.
    `run_loss(inputs, targets)` is the runner's forward and loss of one micro-batch;
    `left_out`, a context both runs go in (a load-balancing loss as zero: meshfit's own,
    coupling/moe.py). Returns the buffers the forward updates from a rank's tokens
    (statistics.py: the runner refuses or says them); each pass starts from the same
    buffers."""
    found: list[_Found] = []
    departures: list[_Departure] = []
    windows = _windows(sequence, inputs, targets)
    with held_still(model) as buffers, left_out or contextlib.nullcontext():
        seen_statistics = TokenStatisticsSeen(buffers)
        first = None
        for row in windows:
            recorded = _outputs_recorded(model)
            seen = _outputs_recorded(model)
            with recorded:
                whole = _whole_window(run_loss, row, inputs, targets, sequence.cp)
            first = first or whole
            seen_statistics.whole_done()
            local_in, local_targets = sequence.local(*row)
            with seen, sequence.running():
                try:
                    part = run_loss(local_in, local_targets)
                except _FAILURES as exc:  # the window ran whole: the cut is what failed
                    if collective_failed(exc):
                        raise
                    raise _cut_refused(inputs, sequence.cp, local_in, exc) from exc
            seen_statistics.cut_done()
            difference = _difference(whole, part, sequence.group)
            departures.append(_departure(recorded, seen, sequence))
            if _has_targets(whole):
                found.append(_Found(difference, whole[0].dtype, None, _masked_mean(whole, row)))
        statistics = seen_statistics.agreed(
            first[0] if first is not None else torch.zeros(()),
            lambda: run_loss(*windows[0])[0],
            _ROUNDING.get(first[0].dtype, 1e-2) if first is not None else 1e-2,
        )
    verdict = found[0] if found else _Found()
    verdict.moved(model, _earliest(departures))  # every window's modules tell
    _verdict(verdict)
    return statistics


def check_staged_sequence_split(
    runner: Any, inputs: Any, targets: Any, left_out: Any = None
) -> None:
    """check_sequence_split under pipeline parallel, where no rank holds the whole model:
    the window goes through the stages twice, whole and cut (each stage sends both
    results to the next stage's rank), the last stage compares the two losses, and each
    stage names the first of its modules whose output for its tokens departs."""
    sequence, model = runner.sequence, runner.model
    found: list[_Found] = []
    departures: list[_Departure] = []
    with held_still(model), left_out or contextlib.nullcontext():
        for row in _windows(sequence, inputs, targets):
            local = sequence.local(*row)
            losses, departure = _through_the_stages(runner, row, local)
            departures.append(departure)
            if losses is not None:  # the last stage
                whole, part = losses
                difference = _difference(whole, part, sequence.group)
                if _has_targets(whole):
                    found.append(_Found(difference, whole[0].dtype, None, _masked_mean(whole, row)))
    verdict = found[0] if found else _Found()
    verdict.moved(model, _earliest(departures))
    _verdict(verdict)


# What a model raises on input it cannot take (runtime/batch_errors.py's, less those a
# forward on tensors of the right kind raises for a key it lacks)
_FAILURES = (RuntimeError, ValueError, IndexError, TypeError)


def _whole_window(
    run_loss: Callable, row: tuple[Any, Any], inputs: Any, targets: Any, cp: int
) -> Any:
    """The window's loss, computed whole. cp reads every tensor of the sequence's length
    as the sequence, so a model that fails on the window (a speech model's convolutions
    over a window of its audio samples) may be failing on the cut, not the batch: the
    first row is then run whole, and where it runs the plan is refused naming the
    tensors cut; where it fails too, the error is the batch's, and goes on as it was."""
    try:
        return run_loss(*row)
    except MeshfitError:
        raise
    except _FAILURES as exc:
        if collective_failed(exc):
            raise
        try:
            run_loss(slice_rows(inputs, 0, 1), slice_rows(targets, 0, 1))
        except Exception:  # noqa: BLE001 - the batch's own error: the step says it
            raise exc from None
        raise _cut_refused(inputs, cp, row[0], exc) from exc


def _cut_refused(inputs: Any, cp: int, window: Any, exc: BaseException) -> MeshfitError:
    from meshfit.parallel.context import _sequence_length
    from meshfit.runtime.batch_errors import one_line

    length, width = _sequence_length(inputs), _sequence_length(window)
    named = inputs.items() if isinstance(inputs, Mapping) else [("inputs", inputs)]
    cut = [
        k for k, t in named if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[1] == length
    ]
    return MeshfitError(
        f"context parallel cannot cut this model's sequences: cp={cp} cuts the second "
        f"dimension of {', '.join(cut)} ({length} long) as the sequence, and the model, "
        f"which runs on the batch's first row whole, failed on {width} of those "
        f"positions: {one_line(exc)}. cp is for token sequences the model reads through "
        f"attention; train this model without cp"
    )


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
    departed: float = 0.0  # a module's departure as a share of its dtype's _DEPARTS
    departure: float = 0.0  # that departure, relative
    # `where`'s place: its pipeline stage, then among that stage's modules (the earliest
    # departing module is the one named)
    order: tuple[int, int] = (-1, -1)

    def moved(self, model: nn.Module, departure: _Departure) -> None:
        """Take in how the cut moved the modules' outputs."""
        self.where = _named(model, departure.where)
        self.departed, self.departure = departure.share, departure.size
        if departure.where is not None:
            names = (name for name, _ in model.named_modules())
            place = next(i for i, name in enumerate(names) if name == departure.where)
            self.order = (departure.stage, place)


@dataclasses.dataclass
class _Departure:
    """How the cut moved the modules' outputs for this rank's tokens: the first module
    (in call order) past its dtype's _DEPARTS, else the first past _NAMED; the largest
    departure as a share of its threshold, and its size."""

    where: str | None = None
    share: float = 0.0
    size: float = 0.0
    stage: int = 0  # the pipeline stage `where` is in


def _verdict(found: _Found) -> None:
    """The same decision on every rank: the largest difference of any rank, as a share of
    its rounding; the first departing module any rank found, named. With no module
    departing, the loss itself is what the cut changes: a mean over masked tokens (each
    rank's mean weighs its own count) is named with its fix."""
    rounding = _ROUNDING.get(found.dtype, 1e-2) if found.dtype is not None else 1.0
    verdict = torch.tensor(
        [
            found.difference / rounding, found.difference, float(found.masked_mean),
            found.departed, found.departure,
        ],
        dtype=torch.float64,
    )  # fmt: skip
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    if float(verdict[0]) <= 1.0 and float(verdict[3]) <= 1.0:
        return
    names: list[Any] = [None] * dist.get_world_size()
    # all_gather_object unpickles: the bytes come from the ranks of this run's process
    # group, joined through meshfit's signed rendezvous (as _received's, below)
    dist.all_gather_object(names, (found.departed > 1.0, found.order, found.where))
    # the earliest module in the model that departs past its share (under pp a later
    # stage's modules depart too: their input did), else the first rank's named one
    departed = [(order, where) for faulty, order, where in names if faulty and where]
    where = min(departed)[1] if departed else next((n[2] for n in names if n[2]), None)
    changed = (
        f"on a window of the batch's first sequence the cut changes the loss by "
        f"{float(verdict[1]):.1e} (relative)"
    )
    if float(verdict[3]) > 1.0:
        changed += f" and a module's output for a rank's tokens by {float(verdict[4]):.1e}"
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
        f"transformers' attention functions (causal, or an encoder's) or "
        f"F.scaled_dot_product_attention with is_causal=True, "
        f"and its positions come from position_ids or torch.arange(sequence length); a "
        f"layer that carries a state along the sequence (a convolution over tokens, a "
        f"state-space or linear-attention scan) cannot be cut; train this model without cp"
    )


def _named(model: nn.Module, where: str | None) -> str | None:
    """A module's name as the user knows it (without DDP's wrapper) and its class, with
    the layer it sits in (a Linear of a state-space mixer says little alone)."""
    if where is None:
        return None
    named = f"{where.removeprefix('module.')} ({type(model.get_submodule(where)).__name__})"
    parent = where.rpartition(".")[0]
    if parent and parent != "module":
        kind = type(model.get_submodule(parent)).__name__
        named += f" in {parent.removeprefix('module.')} ({kind})"
    return named


def _masked_mean(whole: tuple[torch.Tensor, torch.Tensor | None], row: tuple[Any, Any]) -> bool:
    """Whether the loss is a mean (no count) over targets some of which are ignored
    (IGNORED, -100: padding, prompts), in the targets or in the inputs' labels."""
    if whole[1] is not None:
        return False
    inputs, targets = row
    labels = [targets, inputs.get("labels") if isinstance(inputs, Mapping) else None]
    return any(
        isinstance(t, torch.Tensor) and not t.is_floating_point() and bool((t == IGNORED).any())
        for t in labels
    )


def _through_the_stages(
    runner: Any, row: tuple[Any, Any], local: tuple[Any, Any]
) -> tuple[tuple | None, _Departure]:
    """One window through this rank's stages, whole (`row`) and cut (`local`), in stage
    order: (the whole and cut losses on the last stage, else None; how the cut moved the
    outputs of this rank's stages' modules)."""
    sequence, group = runner.sequence, runner.group
    stages = {s.stage_index: s for s in runner.stages}
    anyone = runner.stages[0]
    owner, count = anyone.stage_index_to_group_rank, anyone.num_stages
    me, device = dist.get_rank(group), anyone.device
    whole = cut = losses = None
    moved: list[_Departure] = []
    for index in sorted(stages):
        if index > 0 and owner[index - 1] != me:
            whole, cut = _received(owner[index - 1], group, device)
        module = stages[index].submod
        first = index == 0
        recorded = _outputs_recorded(model := runner.model)
        seen = _outputs_recorded(model)
        with recorded:
            whole = module(*_stage_args(first, row[0], whole), model_inputs=row[0])
        with seen, sequence.running():
            cut = module(*_stage_args(first, local[0], cut), model_inputs=local[0])
            if index == count - 1:
                loss_fn = runner.stage_loss.loss_fn
                form = getattr(module, "module", module).output_form
                part = split_loss(loss_fn(form.restore(cut), local[1]))
        if index == count - 1:
            losses = (split_loss(loss_fn(form.restore(whole), row[1])), part)
        moved.append(dataclasses.replace(_departure(recorded, seen, sequence), stage=index))
        if index < count - 1 and owner[index + 1] != me:
            _send((whole, cut), owner[index + 1], group)
    return losses, _earliest(moved)


def _earliest(moved: list[_Departure]) -> _Departure:
    """The departures of several forwards (stages in order, windows) as one: the first
    module past its share, else the first named; the largest share and its size."""
    worst = max(moved, key=lambda d: d.share, default=_Departure())
    faulty = next((d for d in moved if d.share > 1), None)
    named = faulty or next((d for d in moved if d.where is not None), _Departure())
    return _Departure(named.where, worst.share, worst.size, named.stage)


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
    """Each module's first floating output of the forward, in call order (`outputs`), and
    whether any ran under autocast (`lowered`: its float32 outputs then carry bfloat16's
    rounding: a right cut moved Gemma 2's by 2.6e-3 under precision=bf16, measured)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.lowered = False
        self.names = {id(m): n for n, m in model.named_modules()}
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        def hook(module: nn.Module, _args: Any, output: Any) -> None:
            found = [t for t in tensors_in(output) if t.is_floating_point() and t.ndim >= 2]
            if found:
                name = self.names.get(id(module), "")
                self.outputs.setdefault(name, []).append(found[0].detach())
                self.lowered = self.lowered or torch.is_autocast_enabled(found[0].device.type)

        self.handles = [m.register_forward_hook(hook) for m in self.model.modules()]

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()


def _departure(whole: _outputs_recorded, cut: _outputs_recorded, sequence: Any) -> _Departure:
    """How far each module's output on this rank's tokens differs between the whole
    sequence and the cut one (modules in call order of the whole forward)."""
    found = _Departure()
    lowered = whole.lowered or cut.lowered
    positions = sequence.state.positions if sequence.state is not None else None
    if positions is None:
        return found
    length = sequence.state.length
    # padding's outputs are not compared: a padding query before a row's first real token
    # has no key to read, and cp has it read itself (attention.py) where transformers'
    # masks do otherwise; no real token reads what it computes
    real = sequence.state.real
    kept = None if real is None else real[0].to(positions.device)[positions].nonzero()[:, 0]
    named = faulty = None
    for name, outputs in whole.outputs.items():
        if not name or name not in cut.outputs:
            continue
        for full, part in zip(outputs, cut.outputs[name], strict=False):
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
            size = float((mine.double() - part.double()).norm() / scale)
            share = size / (_DEPARTS_HALF if lowered else _DEPARTS.get(full.dtype, _DEPARTS_HALF))
            named = named or (name if share > _NAMED else None)
            if share > 1 and faulty is None:
                faulty = name
            if share > found.share:
                found.share, found.size = share, size
    found.where = faulty or named
    return found
