"""Batches and module inputs as trees: a tensor, or tuples / lists / mappings of them, and
how a model is called on them.

A batch's rows are the first dimension of its tensors, with one exception: a list under
a mapping's key whose length is the batch's rows holds one item per sample (a Hugging
Face collator's `labels` for object detection, one dict of boxes and classes per image;
Mask2Former's `mask_labels`, one tensor per image): it is split by its items, never by
the tensors inside them (`batch_rows`, `slice_rows`)."""

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


def batch_rows(tree: Any) -> int:
    """The batch's rows: the first dimension of its first tensor of one or more
    dimensions outside the lists under a mapping's keys (those may hold one item per
    sample); 0 when it has none."""
    for tensors in (_tensors_outside_lists(tree), tensors_in(tree)):
        found = [t for t in tensors if t.ndim >= 1]
        if found:
            return found[0].shape[0]
    return 0


def is_per_sample(value: Any, rows: int) -> bool:
    """Whether `value`, found under a mapping's key, is a list of one item per sample: a
    list of `rows` mappings or tensors (what a collator yields where the samples' items
    cannot be stacked: each image's boxes)."""
    return (
        isinstance(value, list)
        and rows > 0
        and len(value) == rows
        and (
            all(isinstance(v, Mapping) for v in value)
            or all(isinstance(v, torch.Tensor) for v in value)
        )
    )


def per_sample_lists(tree: Any) -> list[list]:
    """The lists of one item per sample in a batch (`is_per_sample`)."""
    rows = batch_rows(tree)
    found: list[list] = []

    def visit(node: Any) -> None:
        if isinstance(node, Mapping):
            for value in node.values():
                if is_per_sample(value, rows):
                    found.append(value)
                else:
                    visit(value)
        elif isinstance(node, (tuple, list)):
            for item in node:
                visit(item)

    visit(tree)
    return found


def batched_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a batch that hold its samples in their rows: every tensor outside
    the lists of one item per sample."""
    rows = batch_rows(tree)

    def visit(node: Any) -> list[torch.Tensor]:
        if isinstance(node, torch.Tensor):
            return [node]
        if isinstance(node, Mapping):
            return [t for v in node.values() if not is_per_sample(v, rows) for t in visit(v)]
        if isinstance(node, (tuple, list)):
            return [t for item in node for t in visit(item)]
        return []

    return visit(tree)


def slice_rows(tree: Any, start: int, stop: int, rows: int | None = None) -> Any:
    """Rows `start:stop` of a batch: of every tensor of one or more dimensions whose first
    dimension is the batch's `rows` (found from the batch when not given), and the items
    `start:stop` of each list of one item per sample; anything else as it is."""
    rows = batch_rows(tree) if rows is None else rows

    def cut(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node[start:stop] if node.ndim >= 1 and node.shape[0] == rows else node
        if isinstance(node, Mapping):
            return {k: v[start:stop] if is_per_sample(v, rows) else cut(v) for k, v in node.items()}
        if isinstance(node, (tuple, list)):
            return type(node)(cut(item) for item in node)
        return node

    return cut(tree)


def _tensors_outside_lists(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [
            t for v in tree.values() if not isinstance(v, list) for t in _tensors_outside_lists(v)
        ]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors_outside_lists(item)]
    return []


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
