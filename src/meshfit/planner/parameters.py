"""Parameter counts of a profile's parts (planner/profile.py): each block's own, its
experts' apart (expert parallel places them), and the head's and tail's, decided as
meshfit's pipeline cut decides them (registration order around the stack)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from meshfit.parallel.experts import find_expert_layers


def count_parameters(model: nn.Module, stack: Any, parts: dict[str, Any]) -> None:
    """Fill each PartCost of `parts` ("head", the blocks' keys, "tail") with its
    parameter elements, its largest, and its experts' apart."""
    if not stack.keys:
        _count_into(parts["head"], model.parameters(), {})
        return
    in_blocks: set[int] = set()
    for key, block in zip(stack.keys, stack.blocks, strict=True):
        unique = {id(p): p for p in block.parameters()}
        experts = {
            id(p): p
            for layer in find_expert_layers(block)
            for p in layer.module.parameters(recurse=False)
        }
        _count_into(parts[key], unique.values(), experts)
        parts[key].trains = any(p.requires_grad for p in unique.values())
        in_blocks.update(unique)
    # Outside the blocks: a parameter belongs to the head if a module that runs before
    # the blocks holds it; meshfit's pipeline cut decides the same way (registration
    # order of the modules around the stack).
    before, after = _around(model, stack)
    for name, ids in (("head", before), ("tail", after)):
        _count_into(parts[name], (p for i, p in ids.items() if i not in in_blocks), {})


def _count_into(part: Any, params: Iterable[nn.Parameter], experts: dict) -> None:
    """`part`'s parameter elements and its largest; its `experts`' (by id) apart."""
    sizes = [p.numel() for p in params if id(p) not in experts]
    expert_sizes = [p.numel() for p in experts.values()]
    part.params = sum(sizes) + sum(expert_sizes)
    part.largest_param = max(sizes, default=0)
    part.expert_params = sum(expert_sizes)
    part.largest_expert = max(expert_sizes, default=0)


def _around(
    model: nn.Module, stack: Any
) -> tuple[dict[int, nn.Parameter], dict[int, nn.Parameter]]:
    from meshfit.parallel.pipeline.cut import _head_tail_parameters

    head, tail = _head_tail_parameters(model, stack)
    return {id(p): p for _, _, p in head}, {id(p): p for _, _, p in tail}


def tied_parameters(model: nn.Module, stack: Any) -> int:
    """Elements of the parameters used both before and after the blocks (tied)."""
    head, tail = _around(model, stack)
    return sum(p.numel() for i, p in head.items() if i in tail)
