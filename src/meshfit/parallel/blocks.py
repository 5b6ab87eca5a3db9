"""Finding a model's repeated unit: the blocks that tensor and pipeline parallel split.

Most models that need splitting are a stack of same-type blocks held in one
`nn.ModuleList`, `nn.Sequential` or `nn.ModuleDict` (transformer layers, ResNet stages;
torchtitan keeps its layers in a ModuleDict). A plain `nn.Sequential` model is its own
stack, whatever its children are. Where the guess is wrong (two stacks, or blocks of
several types), the user names the container: `parallelize(..., blocks="model.layers")`,
which tp, pp, recomputation and fsdp then all use (`use_blocks`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn

from meshfit.errors import MeshfitError


@dataclass
class BlockStack:
    name: str  # the container's qualified name ("" for a Sequential model itself)
    container: nn.Module  # the ModuleList / Sequential holding the blocks
    keys: list[str]  # the blocks' names inside the container ("0", "1", ...)

    @property
    def blocks(self) -> list[nn.Module]:
        return [self.container._modules[k] for k in self.keys]

    def qualified(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# The containers users named with `blocks=`, by model (weakly: the model decides when
# it is freed).
_NAMED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def use_blocks(model: nn.Module, path: str) -> BlockStack:
    """Make `path` (the qualified name of a ModuleList / Sequential / ModuleDict in
    `model`, "" for a Sequential model itself) the model's blocks for every form."""
    modules = dict(model.named_modules())
    container = modules.get(path)
    if not isinstance(container, CONTAINERS) or len(container) == 0:
        candidates = [n or "''" for n, m in modules.items() if isinstance(m, CONTAINERS) and len(m)]
        what = "is not in the model" if container is None else f"is a {type(container).__name__}"
        raise MeshfitError(
            f"blocks={path!r} {what}; name a non-empty nn.ModuleList, nn.Sequential or "
            f"nn.ModuleDict holding the repeated blocks"
            + (f", e.g. one of: {', '.join(candidates[:8])}" if candidates else "")
        )
    _NAMED[model] = path
    return BlockStack(path, container, list(container._modules))


KERAS_LAYERS = (
    "it is a Keras model, whose layers keep their weights in one table of the model "
    "(_torch_params), not in torch sub-modules"
)


def keras_model(model: nn.Module) -> bool:
    """A Keras 3 model on the torch backend: an nn.Module whose layers are not modules."""
    return type(model).__module__.startswith("keras.")


def find_blocks(model: nn.Module) -> BlockStack:
    """The model's stack of repeated blocks: the container named with `use_blocks`, the
    model itself when it is an `nn.Sequential`, else the largest ModuleList /
    Sequential / ModuleDict whose children all have one type (ties go to the first
    registered). A container of one block counts (a 1-layer model still has its layer
    stack) when that block has parameters."""
    if model in _NAMED:
        path = _NAMED[model]
        return BlockStack(path, model.get_submodule(path), list(model.get_submodule(path)._modules))
    if type(model) is nn.Sequential and len(model) > 0:
        return BlockStack("", model, list(model._modules))
    best: BlockStack | None = None
    for name, module in model.named_modules():
        if not isinstance(module, CONTAINERS) or len(module) == 0:
            continue
        if len(module) == 1 and not any(True for _ in module.parameters()):
            continue
        types = {type(child) for child in module.children()}
        if len(types) != 1:
            continue
        if best is None or len(module) > len(best.keys):
            best = BlockStack(name, module, list(module._modules))
    if best is None and keras_model(model):
        raise MeshfitError(
            f"cannot find repeated blocks in {type(model).__name__}: {KERAS_LAYERS}; pipeline "
            f"and tensor parallel cannot cut or split it: train it with dp or fsdp, which "
            f"take it as it is"
        )
    if best is None:
        raise MeshfitError(
            f"cannot find repeated blocks in {type(model).__name__}: meshfit looks for an "
            f"nn.ModuleList, nn.Sequential or nn.ModuleDict of same-type blocks (e.g. "
            f"transformer layers). Name the container holding them "
            f"(parallelize(..., blocks='model.layers')), or for tensor parallel give a "
            f"plan (parallelize(..., tp_plan={{'module.name': 'colwise'}}))"
        )
    return best
