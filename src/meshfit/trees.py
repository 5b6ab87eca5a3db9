"""Batches and module inputs as trees: a tensor, or tuples / lists / dicts of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in tensors_in(item)]
    return []


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor in `tree`, keeping its shape."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    return tree
