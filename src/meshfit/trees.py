"""Batches and module inputs as trees: a tensor, or tuples / lists / mappings of them, and
how a model is called on them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    if isinstance(tree, Mapping):  # dicts, and a collator's BatchEncoding (a UserDict)
        return [t for item in tree.values() for t in tensors_in(item)]
    return []


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor in `tree`, keeping its shape (mappings become dicts)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(t, fn) for t in tree)
    if isinstance(tree, Mapping):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    return tree


def call_model(model: nn.Module, inputs: Any, **extra: Any) -> Any:
    """The model on a batch's inputs, as the model takes them: a mapping (a collator's
    dict: input_ids, attention_mask, ...) as keyword arguments, anything else as the one
    positional argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs, **extra)
    return model(inputs, **extra)


def call_forward(model: nn.Module, inputs: Any) -> Any:
    """`call_model` through the class's own forward (no module hooks of `model` itself)."""
    forward = type(model).forward
    return forward(model, **inputs) if isinstance(inputs, Mapping) else forward(model, inputs)
