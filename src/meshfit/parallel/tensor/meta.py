"""Tensor parallel on a model built on meta: split as it is, checked on a small copy.

The split of a model with values is derived by tracing one forward and checked by
running the split model against the unsplit one (outputs, gradients, which stored head
counts become local): that needs values, and the whole unsplit model on every rank is
what building on meta avoids. So the derivation and every check run on a twin: a copy
of the model that keeps, in each container of blocks, one block of each kind (same
modules, same shapes), built on this rank's device with the model's own initialisation (under a
forked random state, so the model's own values still equal one process's). The
twin's blocks answer for the blocks of their kind: the plan, the parameters whose
gradients are summed, the experts' weights and the local head counts the twin settled
are carried to every block of that kind, and the model on meta is split by them with no
values (materialize.py fills each rank's shards later, as it does for fsdp).

Extra memory while this runs: the twin (the embeddings, the layers outside the blocks
and one block of each kind) and the backward check's unsplit gradients of its first
block (narrowed to this rank's part as each module is split: check.narrow), freed
before the model's own parts are materialized. A twin whose forward fails (a model that
indexes its blocks by a count it keeps elsewhere) is refused in one line.
"""

from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks, use_blocks
from meshfit.parallel.tensor.apply import Chosen, _choose, split, split_and_check, split_styles
from meshfit.parallel.tensor.derivation import _Derivation
from meshfit.parallel.tensor.report import TPReport, tp_share
from meshfit.parallel.tensor.trace import _block_units


def apply_on_meta(
    model: nn.Module,
    mesh: DeviceMesh,
    tp_plan: Any,
    example_inputs: Any,
    init: Any = None,
    experts_whole: bool = False,
) -> TPReport | None:
    """apply_tensor_parallel for a model on meta (see the module doc)."""
    if tp_plan is not None or type(model) is nn.Sequential:  # nothing traced, no check
        chosen = _choose(model, mesh.size(), tp_plan, None, experts_whole)
        split(model, mesh, split_styles(model, chosen), chosen.derivation)
        if chosen.derivation is None:
            return None
        return TPReport(tp_share(model, chosen.plan), {}, dict(chosen.derivation.whole))
    twin, kinds = _twin(model)
    device = _mesh_device(mesh)
    _materialize(twin, init, device)
    try:
        checked = split_and_check(twin, mesh, None, example_inputs, experts_whole)
    except MeshfitError as error:
        raise MeshfitError(
            f"{error} (tensor parallel on a model built on meta derives and checks its "
            f"split on a copy with one block of each kind)"
        ) from None
    derivation = checked.derivation
    assert derivation is not None  # derived: no tp_plan
    modules = dict(model.named_modules())
    twin_modules = dict(twin.named_modules())
    for owner, attrs in derivation.local_attrs.items():  # the values the twin settled
        for full in _renamed(owner, kinds):
            for attr in attrs:
                setattr(modules[full], attr, getattr(twin_modules[owner], attr))
    mapped = _Derivation(
        plan=_renamed_dict(derivation.plan, kinds),
        local_attrs=_renamed_dict(derivation.local_attrs, kinds),
        weights=_renamed_dict(derivation.weights, kinds),
        owners=_renamed_dict(derivation.owners, kinds),
        whole=dict(derivation.whole),
        summed=[full for name in derivation.summed for full in _renamed(name, kinds)],
        summed_inputs=[f for name in derivation.summed_inputs for f in _renamed(name, kinds)],
        kv_slices=_renamed_dict(derivation.kv_slices, kinds),
    )
    chosen = Chosen(mapped.plan, mapped, dict(checked.heads))  # heads: outside the blocks
    # freed now, not at the next collection: the split left reference cycles in it (its
    # modules' forwards rebound), and the model's own parts are materialized next
    del twin, twin_modules, checked
    gc.collect()
    split(model, mesh, split_styles(model, chosen), mapped)
    return TPReport(tp_share(model, mapped.plan), chosen.heads, dict(mapped.whole))


def _twin(model: nn.Module) -> tuple[nn.Module, dict[str, list[str]]]:
    """(a copy of `model` on meta that keeps one block of each kind in each container of
    blocks, {the twin's name of a kept block: the names of the model's blocks of its
    kind})."""
    stack = find_blocks(model)
    units = _block_units(model, stack)
    containers: OrderedDict[str, list[tuple[str, nn.Module]]] = OrderedDict()
    for name, block in units:
        parent, _, key = name.rpartition(".")
        containers.setdefault(parent, []).append((key, block))
    twin = copy.deepcopy(model)
    use_blocks(twin, stack.name)  # its pruned container is still the stack
    kinds: dict[str, list[str]] = {}
    for parent, blocks in containers.items():
        kept: dict[tuple, tuple[str, list[str]]] = {}
        for key, block in blocks:
            signature = _signature(block)
            full = f"{parent}.{key}" if parent else key
            if signature in kept:
                kept[signature][1].append(full)
            else:
                kept[signature] = (key, [full])
        container = twin.get_submodule(parent) if parent else twin
        renumber = isinstance(container, (nn.ModuleList, nn.Sequential))
        old = container._modules
        container._modules = OrderedDict()
        for index, (key, fulls) in enumerate(kept.values()):
            new_key = str(index) if renumber else key
            container._modules[new_key] = old[key]
            kinds[f"{parent}.{new_key}" if parent else new_key] = fulls
    return twin, kinds


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks the same kind: their modules' types and their tensors'
    names, shapes and dtypes."""
    return (
        tuple((n, type(m).__name__) for n, m in block.named_modules()),
        tuple((n, tuple(t.shape), t.dtype) for n, t in block.state_dict(keep_vars=True).items()),
    )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of `mesh` (its GPU under NCCL, else the CPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _materialize(twin: nn.Module, init: Any, device: torch.device) -> None:
    """The twin's values, by the model's own initialisation, on `device`; the random
    state is left as it was (the CPU's and this GPU's), so the model's own
    materialization draws what one process would."""
    from meshfit.weights.initializer import plan_initialization
    from meshfit.weights.materialize import materialize

    gpus = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        initializer = plan_initialization(twin, init)
        materialize(initializer, twin, device, None)


def _renamed(name: str, kinds: dict[str, list[str]]) -> list[str]:
    """The model's names for the twin's `name`: one per block of its kind inside a kept
    block, else the name itself."""
    for kept, fulls in kinds.items():
        if name == kept or name.startswith(kept + "."):
            return [full + name[len(kept) :] for full in fulls]
    return [name]


def _renamed_dict(table: dict[str, Any], kinds: dict[str, list[str]]) -> dict[str, Any]:
    return {full: value for name, value in table.items() for full in _renamed(name, kinds)}
