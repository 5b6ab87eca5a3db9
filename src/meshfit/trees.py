"""Batches and module inputs as trees: a tensor, or tuples / lists / mappings of them, and
how a model is called on them.

A batch's rows are the first dimension of its tensors, with one exception: a list under
a mapping's key whose length is the batch's rows holds one item per sample (a Hugging
Face collator's `labels` for object detection, one dict of boxes and classes per image;
Mask2Former's `mask_labels`, one tensor per image): it is split by its items, never by
the tensors inside them (`batch_rows`, `slice_rows`). And vision-language batches that
pack every image's patches along one dimension (`PACKED`: Qwen2-VL's `pixel_values`, one
row per patch of every image, with `image_grid_thw`, one row per image, and what has one
entry per image beside it: `PER_IMAGE`) are split by the images of each sample, which
`mm_token_type_ids` marks (`packed_spans`)."""

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


# Vision-language batches that pack every image's patches along one dimension: the key
# of the patches, the key of each image's (t, h, w) grid of patches, and the id that
# `mm_token_type_ids` gives the image's tokens in the text (transformers' processors for
# Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V: images, then videos).
PACKED = (("pixel_values", "image_grid_thw", 1), ("pixel_values_videos", "video_grid_thw", 2))
# Keys beside a grid with one entry per image of it, split with the images: Qwen2.5-VL's
# processor gives each video's seconds per temporal patch (its rotary time positions)
PER_IMAGE = {"video_grid_thw": ("second_per_grid_ts",)}


def packs_images(mapping: Any) -> bool:
    """Whether a batch's mapping holds a grid of packed images (`PACKED`)."""
    return isinstance(mapping, Mapping) and any(
        isinstance(mapping.get(grid), torch.Tensor) for _, grid, _ in PACKED
    )


def packed_spans(mapping: Any) -> dict[str, list[tuple[int, int]]]:
    """For each packed key of a batch's mapping (the patches and their grid), each
    sample's (start, stop) along its first dimension: its images are those whose tokens
    make up its count of `mm_token_type_ids` of their kind, in order (every image has
    its patches / merge tokens, one merge for the batch). {} where nothing is packed, or
    the counts do not add up (the batch's checks then name it)."""
    if not packs_images(mapping):
        return {}
    types = mapping.get("mm_token_type_ids")
    spans: dict[str, list[tuple[int, int]]] = {}
    for patches_key, grid_key, kind in PACKED:
        grid, patches = mapping.get(grid_key), mapping.get(patches_key)
        if not isinstance(grid, torch.Tensor) or not isinstance(patches, torch.Tensor):
            continue
        if not isinstance(types, torch.Tensor) or grid.ndim != 2 or types.ndim != 2:
            return {}
        sizes = grid.prod(1).tolist()
        images = _images_of_each_sample(sizes, (types == kind).sum(1).tolist())
        if images is None or patches.shape[0] != sum(sizes):
            return {}
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        spans[grid_key] = images
        spans[patches_key] = [(offsets[a], offsets[b]) for a, b in images]
        for key in PER_IMAGE.get(grid_key, ()):
            beside = mapping.get(key)
            if isinstance(beside, (torch.Tensor, list)) and len(beside) == len(sizes):
                spans[key] = images
    return spans


def _images_of_each_sample(patches: list[int], tokens: list[int]) -> list[tuple[int, int]] | None:
    """Each sample's (first, last + 1) image, from the images' patch counts and the
    samples' image-token counts; None where they do not add up."""
    total = sum(tokens)
    if total == 0 or sum(patches) % total:
        return None
    merge = sum(patches) // total
    images, i = [], 0
    for wanted in tokens:
        first, got = i, 0
        while got < wanted and i < len(patches):
            got, i = got + patches[i] // merge, i + 1
        if got != wanted:
            return None
        images.append((first, i))
    return images if i == len(patches) else None


def batch_rows(tree: Any) -> int:
    """The batch's rows: the first dimension of its first tensor of one or more
    dimensions outside the lists under a mapping's keys (those may hold one item per
    sample) and its packed images; 0 when it has none."""
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


def split_by_sample(tree: Any) -> list[str]:
    """The keys of a batch whose samples are not rows of a tensor: lists of one item per
    sample and packed images (what a pipeline's schedule cannot cut into micro-batches)."""
    rows = batch_rows(tree)
    found: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, Mapping):
            packed = packed_spans(node)
            for key, value in node.items():
                if key in packed or is_per_sample(value, rows):
                    found.append(str(key))
                else:
                    visit(value)
        elif isinstance(node, (tuple, list)):
            for item in node:
                visit(item)

    visit(tree)
    return found


def batched_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a batch that hold its samples in their rows: every tensor outside
    the lists of one item per sample and the packed images."""
    rows = batch_rows(tree)

    def visit(node: Any) -> list[torch.Tensor]:
        if isinstance(node, torch.Tensor):
            return [node]
        if isinstance(node, Mapping):
            packed = packed_spans(node)
            return [
                t
                for k, v in node.items()
                if k not in packed and not is_per_sample(v, rows)
                for t in visit(v)
            ]
        if isinstance(node, (tuple, list)):
            return [t for item in node for t in visit(item)]
        return []

    return visit(tree)


def slice_rows(tree: Any, start: int, stop: int, rows: int | None = None) -> Any:
    """Rows `start:stop` of a batch: of every tensor of one or more dimensions whose first
    dimension is the batch's `rows` (found from the batch when not given), the items
    `start:stop` of each list of one item per sample, and those samples' packed images;
    anything else as it is."""
    rows = batch_rows(tree) if rows is None else rows

    def cut(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node[start:stop] if node.ndim >= 1 and node.shape[0] == rows else node
        if isinstance(node, Mapping):
            packed = packed_spans(node)
            # samples without images: no patches and no grid, as a processor gives them
            empty = {k for k, spans in packed.items() if all(a == b for a, b in spans[start:stop])}
            return {
                k: _cut_entry(k, v, packed, rows, start, stop, cut)
                for k, v in node.items()
                if k not in empty
            }
        if isinstance(node, (tuple, list)):
            return type(node)(cut(item) for item in node)
        return node

    return cut(tree)


def _cut_entry(
    key: Any, value: Any, packed: dict, rows: int, start: int, stop: int, cut: Callable
) -> Any:
    if key in packed:
        spans = packed[key][start:stop]
        return value[spans[0][0] : spans[-1][1]]
    if is_per_sample(value, rows):
        return value[start:stop]
    return cut(value)


def _tensors_outside_lists(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        skip = {grid for _, grid, _ in PACKED} | {patches for patches, _, _ in PACKED}
        skip |= {key for keys in PER_IMAGE.values() for key in keys}
        skip = skip if packs_images(tree) else set()
        return [
            t
            for k, v in tree.items()
            if not isinstance(v, list) and k not in skip
            for t in _tensors_outside_lists(v)
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
