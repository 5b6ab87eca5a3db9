"""Applying a plan: derive or take it, check sizes, split with parallelize_module, make the
replicated parts identical on the tp ranks, check the split, and return what was split
(report.TPReport).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    parallelize_module,
)

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.recompute import rebind_forwards
from meshfit.parallel.tensor.check import (
    _check_gradients,
    _check_local_sizes,
    _check_weight_sizes,
    _checked_gradients,
    _column_weights,
    _outputs,
    _settle_local_sizes,
    check_tp_plan,
    check_user_targets,
    narrow,
    reference_gradients,
)
from meshfit.parallel.tensor.derivation import _Derivation
from meshfit.parallel.tensor.derive import _derive
from meshfit.parallel.tensor.report import TPReport, tp_share
from meshfit.parallel.tensor.split import STYLES, Split, TPPlan, _is_channel_layer
from meshfit.parallel.tensor.styles import (
    _ChannelShard,
    _LocalShard,
    _summing,
    _summing_inputs,
    _WeightShard,
)
from meshfit.parallel.tensor.trace import _block_units
from meshfit.trees import call_model


@dataclass
class Chosen:
    """What tensor parallel chose for a model: the plan, the derivation it came from
    (None for the user's own tp_plan), the LM heads split over their outputs and the
    report of it all."""

    plan: dict[str, Any]
    derivation: _Derivation | None
    heads: dict[str, int]
    report: TPReport | None = None


def split_and_check(
    model: nn.Module,
    mesh: DeviceMesh,
    tp_plan: TPPlan | None,
    example_inputs: Any,
    experts_whole: bool = False,
) -> Chosen:
    """apply_tensor_parallel on a model with values: derive (or take) the plan, split,
    and check the split on the traced input."""
    chosen = _choose(model, mesh.size(), tp_plan, example_inputs, experts_whole)
    derivation = chosen.derivation
    styles = split_styles(model, chosen)
    reference, scale, gradients = None, True, {}
    if derivation is not None and derivation.inputs is not None:
        reference = _outputs(model, derivation.inputs, _column_weights(model, derivation.plan))
        if not all(bool(t.isfinite().all()) for t in reference):  # fp16 overflow: unscaled
            scale = False
            reference = _outputs(model, derivation.inputs)
        names = _checked_gradients(model, derivation)
        gradients = reference_gradients(model, derivation.inputs, names)
    after_each = (lambda name: narrow(model, gradients, name)) if gradients else None
    split(model, mesh, styles, derivation, after_each)
    if derivation is not None:
        if reference is not None:
            # the split model's own parameters (sharding replaced the objects)
            scaled = _column_weights(model, derivation.plan) if scale else []
            _settle_local_sizes(model, mesh, derivation, reference, scaled)
            _check_gradients(model, mesh, derivation, gradients)
        chosen.report = TPReport(
            tp_share(model, derivation.plan), chosen.heads, dict(derivation.whole)
        )
    return chosen


def _choose(
    model: nn.Module,
    tp: int,
    tp_plan: TPPlan | None,
    example_inputs: Any,
    experts_whole: bool = False,
) -> Chosen:
    """The plan for `model` (derived and its sizes checked, or the user's), and the LM
    heads a derived plan splits; with `experts_whole`, none of an experts module."""
    if tp_plan is not None:
        plan = {name: style for name, style in tp_plan.items()}
        check_tp_plan(model, {n: s for n, s in plan.items() if isinstance(s, str)}, tp)
        check_user_targets(model, plan)
        return Chosen(plan, None, {})
    derivation = _derive(model, example_inputs, tp, experts_whole)
    plan = dict(derivation.plan)
    check_tp_plan(model, {n: v for n, v in plan.items() if n not in derivation.weights}, tp)
    _check_weight_sizes(model, derivation, tp)
    _check_local_sizes(derivation, tp)
    heads: dict[str, int] = {}
    inputs = derivation.inputs if derivation.inputs is not None else example_inputs
    if inputs is not None and type(model) is not nn.Sequential:  # one with blocks
        heads, kept = gathered_heads(model, inputs, tp)
        derivation.whole.update(kept)
    return Chosen(plan, derivation, heads)


def split_styles(model: nn.Module, chosen: Chosen) -> dict[str, ParallelStyle]:
    """{module name: the ParallelStyle that splits it} for what `chosen` says."""
    derivation = chosen.derivation
    modules = dict(model.named_modules())
    styles: dict[str, ParallelStyle] = {}
    if derivation is not None:
        styles.update(_weight_styles(derivation))
    for name, style in chosen.plan.items():
        if derivation is not None and name in derivation.weights:
            continue  # split with the module holding it (_weight_styles)
        if isinstance(style, ParallelStyle):
            styles[name] = style
        elif isinstance(style, str) and (split := Split.parse(style)) is not None:
            module = modules.get(name)
            if isinstance(module, (nn.Linear, nn.Embedding)) and style == split.kind:
                styles[name] = STYLES[split.kind]()
            elif module is not None and _is_channel_layer(module) and split.column:
                styles[name] = _ChannelShard()
            else:  # Conv1D, a convolution, or a fused projection split chunk by chunk
                styles[name] = _LocalShard(split.kind, split.chunks)
        else:
            raise MeshfitError(
                f"tp_plan[{name!r}] = {style!r}: use 'colwise', 'rowwise' or a "
                f"torch.distributed.tensor.parallel ParallelStyle"
            )
    # the LM heads last: the blocks' reference gradients are narrowed by then (split)
    styles.update({name: ColwiseParallel(output_layouts=Replicate()) for name in chosen.heads})
    return styles


def split(
    model: nn.Module,
    mesh: DeviceMesh,
    styles: dict[str, ParallelStyle],
    derivation: _Derivation | None,
    after_each: Callable[[str], None] | None = None,
) -> None:
    """Split `model` by `styles`; the replicated parts made identical on the tp ranks
    (a model on meta has no values yet: materialize.py gives every rank the same), the
    random-number state shared, the partial gradients of `derivation.summed` summed.
    `after_each(name)` runs as soon as module `name` is split."""
    # DTensor shards each weight from tp rank 0's copy (src_data_rank=0). One module at a
    # time (parallelize_module does the same with the whole dict), so after_each can free
    # what the split module no longer needs.
    for name, style in styles.items():
        parallelize_module(model, mesh, {name: style})
        if getattr(style, "use_local_output", False):
            model.get_submodule(name).register_forward_hook(_owned_output)
        if after_each is not None:
            after_each(name)
    if not any(p.is_meta for p in model.parameters()):
        _broadcast_replicated(model, mesh)
    _share_random_state(mesh)
    if derivation is not None:
        _sum_gradients_over_tp(model, mesh, derivation.summed)
        _keep_own_kv_head(model, mesh, derivation.kv_slices)
        modules = dict(model.named_modules())
        group = mesh.get_group()
        rebind_forwards(
            [modules[n] for n in derivation.summed_inputs],
            lambda inner: _summing_inputs(inner, group),
        )


def _owned_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A torch style's output as a tensor of its own. DTensor's to_local hands back its
    local tensor as a view made inside a custom autograd Function, which autograd forbids
    modifying in place; models do (Falcon's parallel attention: `mlp_output +=
    attention_output`, an `nn.ReLU(inplace=True)` after a split Linear). The copy is one
    activation's memcpy per split layer, beside its matrix product. A chunked LM head's
    stand-in for its logits is handed on as it is (a copy would make it whole:
    parallel/head_loss.py)."""
    from meshfit.parallel.head_loss import is_stand_in

    if not isinstance(output, torch.Tensor) or is_stand_in(output):
        return output
    return output.clone()


def gathered_heads(
    model: nn.Module, inputs: Any, tp: int | None = None
) -> tuple[dict[str, int], dict[str, str]]:
    """({LM head tp splits over its outputs: its output count}, {one it keeps whole: why}).

    Megatron-LM's column-parallel LM head with its output gathered. A head here is an
    nn.Linear outside the blocks, run after them on `inputs` with no other Linear after
    it, that widens what they made (out_features > in_features: a vocabulary); it is the
    largest layer left outside the
    blocks (Llama 3 8B: 0.5B of 8B parameters, 6% of the FLOPs). Each tp rank keeps 1/tp
    of its weights, gradients and optimizer state and computes 1/tp of its outputs; one
    all-gather makes the output whole (the logits, as before), and the gradient of its
    input is all-reduced in backward. Kept whole: a weight shared with another layer (a
    head tied to the token embedding: splitting one would untie them), and a head whose
    outputs `tp` does not divide (GPT-2's 50257). The token embedding stays whole:
    torch's row-parallel embedding has no sharded backward (its gradient is made
    full-size on every rank, then reduced).
    """
    units = _block_units(model, find_blocks(model))
    inside = tuple(f"{name}." for name, _ in units)
    outside = {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not name.startswith(inside)
    }
    wide = {n: m for n, m in outside.items() if m.out_features > m.in_features}
    if not wide:
        return {}, {}
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rsplit(".", 1)[0])
    heads: dict[str, int] = {}
    kept: dict[str, str] = {}
    for name in _run_after_blocks(model, units, wide, outside, inputs):
        module = wide[name]
        others = [o for o in owners.get(id(module.weight), []) if o != name]
        if others:
            kept[name] = f"its weight is tied to {others[0]}'s"
        elif tp is not None and module.out_features % tp:
            kept[name] = f"tp={tp} does not divide its {module.out_features} outputs"
        else:
            heads[name] = module.out_features
    return heads, kept


@torch.no_grad()
def _run_after_blocks(
    model: nn.Module,
    units: list[tuple[str, nn.Module]],
    layers: dict[str, nn.Module],
    others: dict[str, nn.Module],
    inputs: Any,
) -> list[str]:
    """Those of `layers` whose first call on `inputs` (eval mode) comes after the last
    block's, with none of `others` (the other Linears outside the blocks) called after
    it: the head, not an input projection, nor a layer of a second stack the blocks do
    not include (Whisper's decoder, after its encoder's blocks: its fc1 widens too)."""
    calls: list[str] = []
    first: dict[str, int] = {}
    handles = [b.register_forward_hook(lambda *_: calls.append("")) for _, b in units]
    for name, layer in {**others, **layers}.items():

        def seen(*_: Any, name: str = name) -> None:
            first.setdefault(name, len(calls))
            calls.append(name)

        handles.append(layer.register_forward_hook(seen))
    training = model.training
    model.eval()
    try:
        call_model(model, inputs)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    last_block = max((i for i, c in enumerate(calls) if c == ""), default=-1)
    narrow_after = [i for i, c in enumerate(calls) if c and c not in layers]
    return [
        name
        for name in layers
        if first.get(name, -1) > last_block and not any(i > first[name] for i in narrow_after)
    ]


def _weight_styles(derivation: _Derivation) -> dict[str, ParallelStyle]:
    """{module holding split weight parameters: its _WeightShard}."""
    by_owner: dict[str, dict[str, tuple[str, int, int]]] = {}
    for name, how in derivation.weights.items():
        owner, leaf = name.rsplit(".", 1)
        split = Split.parse(derivation.plan[name])
        dim = how.out_dim if split.column else how.in_dim
        by_owner.setdefault(owner, {})[leaf] = (split.kind, dim, split.chunks)
    return {
        owner: _WeightShard(weights, derivation.owners.get(owner, ()))
        for owner, weights in by_owner.items()
    }


def _sum_gradients_over_tp(model: nn.Module, mesh: DeviceMesh, names: list[str]) -> None:
    """Give each parameter in `names` to its module's forward through Megatron's f
    (_CopyToTP: the same value; in backward, the gradient summed over the tp ranks).
    It happens where the parameter is used, so it holds under FSDP2 (which hands the
    forward an unsharded copy) and DDP alike, and in every micro-batch."""
    modules = dict(model.named_modules())
    owners: dict[str, list[str]] = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    for owner, leaves in owners.items():
        modules[owner]._tp_summed_gradients = tuple(leaves)
    group = mesh.get_group()
    rebind_forwards([modules[o] for o in owners], lambda inner: _summing(inner, group))


def _keep_own_kv_head(
    model: nn.Module, mesh: DeviceMesh, kv_slices: dict[str, tuple[int, int]]
) -> None:
    """Each whole k/v projection of `kv_slices` keeps, of its output, the one head this
    tp rank's q heads read: rank r holds q heads [r H/tp, (r+1) H/tp), which read k/v
    head r // (tp / heads) (tp a multiple of heads: derive._shared_kv_projections)."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    modules = dict(model.named_modules())
    for name, (heads, head_dim) in kv_slices.items():
        start = rank // (tp // heads) * head_dim

        def own_head(
            module: nn.Module,
            args: Any,
            output: torch.Tensor,
            start: int = start,
            width: int = head_dim,
        ) -> torch.Tensor:
            return output.narrow(-1, start, width)

        modules[name].register_forward_hook(own_head)


@torch.no_grad()
def _broadcast_replicated(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy tp rank 0's values of every unsharded parameter and buffer to the other tp
    ranks, so replicas start identical however each process initialised its model."""
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        if not isinstance(tensor, DTensor):
            dist.broadcast(tensor.data, src=src, group=group)


def _share_random_state(mesh: DeviceMesh) -> None:
    """Give every tp rank tp rank 0's random-number state (CPU, and the GPU's when one is
    in use): the ranks compute the same replicated activations, so their dropout must
    draw the same masks, whatever seed each process set (a script seeding by rank made
    the tp ranks' copies of the replicated weights drift apart). `fit` seeds the same way
    (Topology.random_stream)."""
    group = mesh.get_group()
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if on_gpu else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(states[0])
    if on_gpu and states[1] is not None:
        torch.cuda.set_rng_state(states[1])
