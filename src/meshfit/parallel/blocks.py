"""Finding a model's repeated unit: the blocks that tensor and pipeline parallel split.

Most models that need splitting are a stack of same-type blocks held in one
`nn.ModuleList` or `nn.Sequential` (transformer layers, ResNet stages). A plain
`nn.Sequential` model is its own stack, whatever its children are.
"""

from __future__ import annotations

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


def find_blocks(model: nn.Module) -> BlockStack:
    """The model's stack of repeated blocks: the model itself when it is an
    `nn.Sequential`, else the largest ModuleList/Sequential whose children all have one
    type (ties go to the first registered). A container of one block counts (a 1-layer
    model still has its layer stack) when that block has parameters."""
    if type(model) is nn.Sequential and len(model) > 0:
        return BlockStack("", model, list(model._modules))
    best: BlockStack | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        if len(module) == 1 and not any(True for _ in module.parameters()):
            continue
        types = {type(child) for child in module.children()}
        if len(types) != 1:
            continue
        if best is None or len(module) > len(best.keys):
            best = BlockStack(name, module, list(module._modules))
    if best is None:
        raise MeshfitError(
            f"cannot find repeated blocks in {type(model).__name__}: meshfit looks for an "
            f"nn.ModuleList or nn.Sequential of same-type blocks (e.g. transformer layers). "
            f"Hold the layers in one, or for pipeline parallel give the cut points yourself "
            f"(parallelize(..., pp_split=[...])), for tensor parallel a plan "
            f"(parallelize(..., tp_plan={{'module.name': 'colwise'}}))"
        )
    return best
