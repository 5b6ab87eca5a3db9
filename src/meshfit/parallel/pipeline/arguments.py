"""What the model's forward gives each block besides the hidden state, and where a
pipeline stage may therefore start.

A stage runs the model's own forward over its blocks only (stage.py), so its loop counts
them from 0: a forward that picks each block's arguments by that count (transformers'
`causal_mask_mapping[config.layer_types[i]]`: Gemma 2 and 3, GPT-OSS, EXAONE 4, OLMo 3,
Qwen2 with sliding windows) gives a later stage's blocks the first blocks' arguments.
That is the same run where they are the same: a stage may start at block s when block
s + i is given what block i is given, for every i (a sliding and a global layer
alternating: the even blocks). Before, the balanced cut gave EXAONE 4's second stage
the other kind's masks and trained another run with no word.

The arguments are read from the cut's example forward (costs.count_costs), or, for a
model on meta whose forward cannot run there (transformers' masks read values), from a
forward over the prologue alone: its weights outside the blocks given as zeros broadcast
to their shapes (one element each), the blocks replaced by recorders that hand the
hidden state on, and the forward left at the last block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshfit.parallel.blocks import BlockStack
from meshfit.parallel.pipeline.checks import _described, _side_inputs
from meshfit.trees import call_model, tensors_in

Arguments = dict[tuple[str, Any], Any]  # {("arg", i) | ("kw", name): token}


def tokens(args: tuple, kwargs: dict, objects: list[Any]) -> Arguments:
    """A block call's inputs besides the hidden state as comparable tokens: a tensor (or
    any object that is not a plain value) by its place in `objects`, the objects met so
    far in this forward (held there, so no id is reused); a tuple or list by its items'
    tokens; plain values as they are."""

    def token(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (tuple, list)):
            return tuple(token(v) for v in value)
        for i, seen in enumerate(objects):
            if seen is value:
                return ("object", i)
        objects.append(value)
        return ("object", len(objects) - 1)

    return {where: token(v) for where, v in _side_inputs(args, kwargs)}


def allowed_starts(
    arguments: list[Arguments], n: int, carried: dict[str, list] | None
) -> tuple[list[bool], str]:
    """For each block index, whether a stage may start there (all True when the
    arguments are unknown), and the first block whose arguments differ from block 0's,
    said for a refusal. Side inputs an earlier block computes (T5's position bias,
    `carried`) cross the cut with the hidden state instead and are not compared."""
    if len(arguments) != n:  # not read
        return [True] * n, ""
    threaded = {where for wheres in (carried or {}).values() for where in wheres}
    given = [{w: t for w, t in a.items() if w not in threaded} for a in arguments]
    differing = ""
    for i in range(1, n):
        if given[i] != given[0]:
            where = next(w for w in {**given[0], **given[i]} if given[0].get(w) != given[i].get(w))
            differing = f"block {i} gets another {_described(where)} than block 0"
            break
    return [all(given[s + i] == given[i] for i in range(n - s)) for s in range(n)], differing


class _Done(Exception):  # noqa: N818 - control flow, not an error
    pass


class _Recorder(nn.Module):
    """Stands for a block: records what the forward gives it, hands the hidden state on
    (the last one leaves the forward)."""

    def __init__(self, into: list[Arguments], objects: list[Any], last: bool) -> None:
        super().__init__()
        self.into, self.objects, self.last = into, objects, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.into.append(tokens(args, kwargs, self.objects) if args else {})
        if self.last:
            raise _Done
        return args[0] if args else None


@contextlib.contextmanager
def recorded_arguments(stack: BlockStack) -> Iterator[list[Arguments]]:
    """Each block's arguments in the forward run inside the context, in block order
    ({} for a block that did not run), filled in when the context ends: the planner's
    profile reads where a stage may start as the cut does (costs.count_costs)."""
    found: dict[int, Arguments] = {}
    objects: list[Any] = []  # held, so no id is reused during the forward

    def recorder(i: int) -> Any:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found.setdefault(i, tokens(args, kwargs, objects))

        return record

    handles = [
        block.register_forward_pre_hook(recorder(i), with_kwargs=True)
        for i, block in enumerate(stack.blocks)
    ]
    recorded: list[Arguments] = []
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()
        recorded.extend(found.get(i, {}) for i in range(len(stack.blocks)))


def arguments_on_meta(model: nn.Module, stack: BlockStack, example_inputs: Any) -> list[Arguments]:
    """Each block's arguments for a model on meta (see the module doc); [] when that
    forward fails too (then nothing is known and any start is taken)."""
    recorded: list[Arguments] = []
    objects: list[Any] = []
    keys = list(stack.keys)
    recorders = {
        k: _Recorder(recorded, objects, last=i == len(keys) - 1) for i, k in enumerate(keys)
    }
    container = stack.container
    everything = container._modules
    device = _device_of(example_inputs)
    try:
        with _zeros_outside(model, stack, device), torch.no_grad():
            container._modules = recorders
            try:
                call_model(model, example_inputs)
            except _Done:
                pass
    except Exception:  # noqa: BLE001 - any failure means: not known
        return []
    finally:
        container._modules = everything
    return recorded if len(recorded) == len(keys) else []


def _device_of(inputs: Any) -> torch.device:
    found = tensors_in(inputs)
    return found[0].device if found else torch.device("cpu")


@contextlib.contextmanager
def _zeros_outside(model: nn.Module, stack: BlockStack, device: torch.device) -> Iterator[None]:
    """Every meta parameter and buffer outside the blocks as a zero broadcast to its
    shape on `device` (one element each) while the context lasts."""
    inside = {id(m) for block in stack.blocks for m in block.modules()}
    swapped: list[tuple[dict, str, Any]] = []
    try:
        for module in model.modules():
            if id(module) in inside:
                continue
            for table in (module._parameters, module._buffers):
                for name, value in list(table.items()):
                    if value is not None and value.is_meta:
                        zero = torch.zeros((), dtype=value.dtype, device=device).expand(value.shape)
                        swapped.append((table, name, value))
                        is_parameter = table is module._parameters
                        table[name] = (
                            nn.Parameter(zero, requires_grad=False) if is_parameter else zero
                        )
        yield
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value
