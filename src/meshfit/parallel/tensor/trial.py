"""A shape-only trial of one block's split, on meta, before anything is split.

The trace finds which projections pair up; it cannot see how the model's own code sizes
what they make. nanoGPT's attention cuts its fused q|k|v at `n_embd` and reshapes to the
input's width `C`: split, its rank-local output has a third of the chunks the code
expects, and no choice of local head counts helps. Splitting the model and checking it
(check.py) would find that, but too late to split anything else: the model is split in
place. So before that, a copy of the first block of each kind runs on meta with each
projection narrowed to one rank's width (no values, no process group, no memory): where
the unsplit copy runs and the narrowed one raises, the innermost sub-layer whose code
raised is kept whole in every block of that kind (`whole`, said in the start-up line)
and the rest is tried again. The split model is still checked on values afterwards, as before; this only
decides what is worth splitting, for the engine and the planner alike.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.tensor.split import Split
from meshfit.trees import call_model, map_tensors


class _Captured(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args_, self.kwargs = args, kwargs


def keep_whole_what_cannot_split(
    model: nn.Module, derivation: Any, tp: int, experts_whole: bool = False
) -> None:
    """Drop from `derivation` (in place) every kind of sub-layer whose narrowed code
    fails on the input of the first block of its kind, recording why in
    `derivation.whole`. Not where tp does not divide the plan's widths or head counts:
    that refusal names the cause. `experts_whole` (beside ep): the experts modules are
    left whole first (leave_experts_whole), and their blocks tried without them."""
    if experts_whole:
        leave_experts_whole(model, derivation)
    from meshfit.errors import MeshfitError
    from meshfit.parallel.tensor.check import check_tp_plan
    from meshfit.parallel.tensor.trace import _block_units

    plain = {n: s for n, s in derivation.plan.items() if n not in derivation.weights}
    try:  # a tp that does not divide a width or a head count is refused by name instead
        check_tp_plan(model, plain, tp)
    except MeshfitError:
        return
    units = _block_units(model, find_blocks(model))
    firsts: dict[type, tuple[str, nn.Module]] = {}
    for name, block in units:  # the first block of each kind (Whisper: encoder, decoder)
        firsts.setdefault(type(block), (name, block))
    for kind, (first, block) in firsts.items():
        kind_units = [name for name, b in units if type(b) is kind]
        _try_kind(model, derivation, tp, first, block, kind_units)


def _try_kind(
    model: nn.Module, derivation: Any, tp: int, first: str, block: nn.Module, units: list[str]
) -> None:
    """keep_whole_what_cannot_split for one kind of block: tried on its `first`, what
    fails is kept whole in every block of its kind (`units`)."""
    captured = None
    for _ in range(8):  # each pass keeps one more kind of sub-layer whole
        # experts' weights are not narrowed here: the trial runs their module whole (its
        # input and output are the block's full width either way), the Linears narrowed
        # (before, a block with experts was not tried at all, and GPT-OSS's attention,
        # whose sinks are one per head, failed in the split model instead)
        experts = _in_block(derivation.weights, first)
        mine = {n: s for n, s in _in_block(derivation.plan, first).items() if n not in experts}
        if not mine:
            return  # nothing left
        if captured is None:
            captured = _block_input(model, block, derivation.inputs)
            if captured is None:
                return
        failed = _failing_sublayer(
            block,
            mine,
            _in_block(derivation.local_attrs, first),
            tp,
            captured,
            _in_block(derivation.kv_slices, first),
        )
        if failed is None:
            return
        layer, why = failed
        _drop(derivation, units, layer)
        derivation.whole[layer] = why


def _in_block(table: dict[str, Any], block: str) -> dict[str, Any]:
    prefix = block + "."
    return {n[len(prefix) :]: v for n, v in table.items() if n.startswith(prefix)}


def _block_input(model: nn.Module, block: nn.Module, inputs: Any) -> tuple | None:
    """The first block's (args, kwargs) on `inputs`, on meta; None when not reached."""
    if inputs is None:
        return None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Captured(args, kwargs)

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            call_model(model, inputs)
    except _Captured as got:
        to_meta = lambda t: t.detach().to("meta")  # noqa: E731
        return map_tensors(got.args_, to_meta), map_tensors(got.kwargs, to_meta)
    except Exception:  # the trace ran this forward already; no verdict
        return None
    finally:
        handle.remove()
        model.train(training)
    return None


def _failing_sublayer(
    block: nn.Module,
    plan: dict[str, Any],
    local_attrs: dict[str, dict[str, int]],
    tp: int,
    captured: tuple,
    kv_slices: dict[str, tuple[int, int]] | None = None,
) -> tuple[str, str] | None:
    """(the sub-layer, inside the block, whose narrowed code raised; why) or None: it ran,
    or no verdict (the unsplit copy fails on meta too, or a layer is not narrowed here).
    A whole k/v projection whose heads the ranks share (`kv_slices`) is narrowed to the
    one head each rank keeps of its output."""
    dtype = None
    if _raised(_on_meta(block), captured) is not None:
        # torch's meta kernel of _grouped_mm (transformers' MoE experts) takes bf16 only,
        # where the CPU kernel takes float32 too: a float32 block is tried in bf16 (its
        # shapes are what is tried; before, GPT-OSS got no trial and its split attention
        # failed in the split model)
        captured = map_tensors(captured, _bf16)
        if _raised(_on_meta(block, torch.bfloat16), captured) is not None:
            return None
        dtype = torch.bfloat16
    trial = _on_meta(block, dtype)
    modules = dict(trial.named_modules())
    for name, style in plan.items():
        if not (isinstance(style, str) and _narrow(modules.get(name), style, tp)):
            return None
    for name, (heads, _) in (kv_slices or {}).items():
        if not _narrow(modules.get(name), "colwise", heads):
            return None
    from meshfit.parallel.tensor.check import _failing_module, local_size_choices

    error = None
    for chosen in local_size_choices(local_attrs):
        for owner, attrs in local_attrs.items():
            for attr, value in attrs.items():
                setattr(modules[owner], attr, value // tp if attr in chosen else value)
        raised = _raised(trial, captured)
        if raised is None:
            return None
        error = error or raised
    layer = _failing_module(trial, error) or ""  # "": the block itself
    if layer in plan:  # a projection raised itself: keep its sub-layer whole
        layer = layer.rpartition(".")[0]
    if not layer:
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return layer, f"its split forward fails ({type(error).__name__}: {first})"


def _on_meta(block: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    copied = _copied(block).to_empty(device="meta").eval()
    return copied if dtype is None else copied.to(dtype)


def _copied(block: nn.Module) -> nn.Module:
    """copy.deepcopy of the block, a tensor that one of its modules keeps from its last
    forward (RecurrentGemma's recurrent state, made by autograd in the traced forward)
    copied detached: deepcopy refuses a tensor autograd made, and the tp split of
    RecurrentGemma failed with torch's "Only Tensors created explicitly by the user
    (graph leaves) support the deepcopy protocol" instead of a verdict."""
    memo: dict[int, Any] = {}
    for module in block.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(block, memo)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _narrow(module: nn.Module | None, style: str, tp: int) -> bool:
    """Give a Linear one rank's widths under `style` (meta tensors); False for anything
    else (its layout is not narrowed here)."""
    split = Split.parse(style)
    if not isinstance(module, nn.Linear) or split is None:
        return False
    out_features, in_features = module.weight.shape
    meta = {"device": "meta", "dtype": module.weight.dtype}
    if split.column:
        if out_features % tp:
            return False
        module.weight = nn.Parameter(torch.empty(out_features // tp, in_features, **meta))
        if module.bias is not None:
            module.bias = nn.Parameter(torch.empty(out_features // tp, **meta))
        module.out_features = out_features // tp
    else:
        if in_features % tp:
            return False
        module.weight = nn.Parameter(torch.empty(out_features, in_features // tp, **meta))
        module.in_features = in_features // tp
    return True


def _raised(block: nn.Module, captured: tuple) -> BaseException | None:
    args, kwargs = copy.deepcopy(captured)  # a cache the block appends to starts empty
    try:
        with torch.no_grad():
            block(*args, **kwargs)
    except Exception as error:
        return error
    return None


def _drop(derivation: Any, units: list[str], layer: str) -> None:
    """Remove `layer` (named inside a block) and what is in it from the share of
    `derivation` of every block in `units` (the blocks of one kind)."""
    _drop_within(derivation, [f"{unit}.{layer}" for unit in units])


def _drop_within(derivation: Any, modules: list[str]) -> None:
    """Remove every module in `modules` and what is in it from `derivation`: its plan's
    entries, weights, sizes, owners, sums and key/value slices."""

    def within(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in modules)

    for table in (derivation.plan, derivation.local_attrs, derivation.weights, derivation.owners):
        for name in [n for n in table if within(n)]:
            del table[name]
    derivation.summed[:] = [n for n in derivation.summed if not within(n)]
    derivation.summed_inputs[:] = [n for n in derivation.summed_inputs if not within(n)]
    for name in [n for n in derivation.kv_slices if within(n)]:
        del derivation.kv_slices[name]


def leave_experts_whole(model: nn.Module, derivation: Any) -> None:
    """Drop what the plan splits inside an experts module (its weights, split as a pair
    with one sum of the module's output: an all-or-nothing unit): expert parallel
    places the experts whole, and each tp rank sends the same tokens to them in its own
    ep group, so nothing of theirs is split or summed over tp. Before the trial of what
    cannot be split (which skips a block while it holds experts' weights to narrow)."""
    from meshfit.parallel.experts import find_expert_layers

    _drop_within(derivation, [layer.name for layer in find_expert_layers(model)])
