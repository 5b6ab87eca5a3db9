"""The global batch and this rank's share of it: what a batch is (a pair, or with
loss_fn="model" the model's mapping), that it splits evenly over the data-parallel ranks
and micro-batches, and the contiguous slice a rank keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from meshfit.errors import MeshfitError
from meshfit.plan import Plan
from meshfit.topology import Topology
from meshfit.trees import (
    PACKED,
    batched_tensors,
    map_tensors,
    packed_spans,
    packs_images,
    slice_rows,
    split_by_sample,
    tensors_in,
)


def check_batch_divides(batch_size: int, topology: Topology, microbatches: int) -> None:
    """Refuse a global batch that does not split evenly over ranks and micro-batches."""
    unit, dp_size = topology.parts(microbatches), topology.dp_size
    if batch_size < 1 or batch_size % unit:
        lower = (batch_size // unit) * unit
        options = [str(n) for n in (lower, lower + unit) if n > 0]
        raise MeshfitError(
            f"a global batch of {batch_size} samples does not split over {dp_size} "
            f"data-parallel rank(s) x {microbatches} micro-batch(es)"
            f"{_default_microbatches(topology.plan, microbatches)} (needs a multiple of "
            f"{unit}); use a batch size of {' or '.join(options)}"
        )


def check_microbatches(size: int, plan: Plan, dp_size: int) -> None:
    """Refuse a rank's share of `size` samples that does not split into the plan's
    micro-batches."""
    microbatches = plan.num_microbatches
    if size % microbatches:
        raise MeshfitError(
            f"this rank's {size} samples do not split into {microbatches} micro-batches"
            f"{_default_microbatches(plan, microbatches)}; make the global batch a multiple "
            f"of {microbatches * dp_size}"
        )


def _default_microbatches(plan: Plan, microbatches: int) -> str:
    """Where the micro-batch count came from, when the user did not choose it: pp's
    default, and the option that changes it."""
    if plan.microbatches is not None or plan.pp == 1 or microbatches != plan.num_microbatches:
        return ""
    return (
        f" (pp={plan.pp}'s default, 2 x pp; choose another with microbatches= in the plan, "
        f"e.g. '{plan},microbatches={plan.pp}')"
    )


def split_batch(batch: Any, model_loss: bool = False) -> tuple[Any, Any]:
    """(inputs, targets) of a batch: a pair as it is; for loss_fn="model" the mapping the
    model takes (inputs) and its labels (targets, for counting), or, for a model that
    computes its loss without labels (CLIP with return_loss=True), a stand-in of one
    zero per sample (the model's output without a loss is refused by the loss)."""
    if model_loss:
        if not isinstance(batch, Mapping):
            raise MeshfitError(
                f"with loss_fn='model' a batch is the mapping the model takes, labels "
                f"included (e.g. a data collator's dict with input_ids, attention_mask and "
                f"labels), not {type(batch).__name__}"
            )
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor):
            return batch, labels
        found = tensors_in(batch)
        if not found or found[0].ndim == 0:
            raise MeshfitError(
                "with loss_fn='model' a batch is the mapping the model takes, with tensors "
                "whose first dimension is the batch (input_ids, attention_mask, labels)"
            )
        return batch, torch.zeros(found[0].shape[0], dtype=torch.long, device=found[0].device)
    return unpack_batch(batch)


def unpack_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping):  # a collator's dict, given to a loss_fn of the user's
        raise MeshfitError(
            f"a batch must be a pair (inputs, targets) for a loss_fn of your own, not "
            f"{type(batch).__name__} (keys {', '.join(map(str, list(batch)[:6]))}): meshfit "
            f"calls loss_fn(model(**inputs), targets). Yield (batch, batch['labels']) from "
            f"your data, or pass loss_fn='model' to train the model's own loss on this dict"
        )
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise MeshfitError(
            f"a batch must be a pair (inputs, targets), not {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    return batch[0], batch[1]


def batch_size(tree: Any, what: str) -> int:
    """The rows of a batch's inputs or targets, after checking every tensor holding
    samples agrees on them (a list of one item per sample under a key counts by its
    length: trees.is_per_sample)."""
    if packs_images(tree) and not packed_spans(tree):
        raise MeshfitError(
            f"{what} pack every image's patches along one dimension (image_grid_thw, as "
            f"Qwen2-VL's processor yields them), and meshfit splits them by sample from "
            f"each sample's image tokens in mm_token_type_ids, which {_packing_fault(tree)}; "
            f"have the processor return mm_token_type_ids (transformers 5's Qwen2-VL "
            f"processors do)"
        )
    tensors = batched_tensors(tree)
    if not tensors or tensors[0].ndim == 0:
        raise MeshfitError(
            f"{what} must be a tensor (or tuple/dict of tensors) whose first dimension is the batch"
        )
    size = tensors[0].shape[0]
    for t in tensors[1:]:
        if t.ndim == 0 or t.shape[0] != size:
            raise MeshfitError(f"the tensors in {what} disagree on the batch size (dim 0)")
    return size


def _packing_fault(mapping: Any) -> str:
    if not isinstance(mapping.get("mm_token_type_ids"), torch.Tensor):
        return "the batch lacks"
    return "do not add up to the images' patches in the grid"


def slice_batch(tree: Any, start: int, stop: int) -> Any:
    return slice_rows(tree, start, stop)


def to_device(tree: Any, device: torch.device) -> Any:
    return map_tensors(tree, lambda t: t.to(device, non_blocking=True))


def local_share(
    inputs: Any, targets: Any, topology: Topology, microbatches: int
) -> tuple[Any, Any]:
    """This rank's contiguous share of a global batch, after checking it divides over
    the data-parallel ranks and `microbatches`."""
    size = batch_size(inputs, "inputs")
    target_size = batch_size(targets, "targets")
    if target_size != size:
        raise MeshfitError(
            f"inputs hold {size} samples but targets hold {target_size}; "
            f"give one target per input sample"
        )
    check_batch_divides(size, topology, microbatches)
    if topology.dp_size > 1:
        check_every_sample_has_images(inputs, topology)
    if topology.plan.pp > 1 and microbatches > 1:
        check_rows_cut_into_microbatches(inputs, topology.plan, microbatches)
    return _share(inputs, topology, size), _share(targets, topology, size)


def check_rows_cut_into_microbatches(inputs: Any, plan: Plan, microbatches: int) -> None:
    """Refuse, under pp with several micro-batches, a batch holding samples other than
    as rows of tensors: torch's schedule cuts every tensor into micro-batches along its
    first dimension (a list of boxes per image would be cut box by box)."""
    keys = split_by_sample(inputs)
    if keys:
        raise MeshfitError(
            f"pipeline parallel cuts each input tensor into {microbatches} micro-batches "
            f"along its first dimension, and this batch holds its samples otherwise in "
            f"{', '.join(repr(k) for k in keys)} (a list of one item per sample, or "
            f"packed images), which meshfit cannot cut yet; use microbatches=1 in plan "
            f"{plan}, or dp/fsdp/tp"
        )


def check_every_sample_has_images(inputs: Any, topology: Topology) -> None:
    """Refuse a batch of packed images (Qwen2-VL's) with a sample that has none, under a
    plan that splits the batch over ranks: a rank whose share, or whose coupling probe's
    half, holds no image skips the vision tower while the others run it, and the ranks'
    collectives no longer pair (measured: fsdp=2 hung in its first step; dp=2 aborted)."""
    spans = packed_spans(inputs)
    grids = [key for _, key, _ in PACKED if key in spans]
    if not grids:
        return
    per_sample = zip(*(spans[key] for key in grids), strict=True)
    bare = [i for i, images in enumerate(per_sample) if all(a == b for a, b in images)]
    if bare:
        shown = ", ".join(map(str, bare[:5])) + (", ..." if len(bare) > 5 else "")
        raise MeshfitError(
            f"sample(s) {shown} of this batch hold no image or video, and plan "
            f"{topology.plan} splits the batch over {topology.dp_size} ranks: a rank whose "
            f"share holds none would skip the vision tower that the others run, which "
            f"meshfit cannot pair yet (its collectives would wait forever); give every "
            f"sample an image (the batches of a dataset that mixes text-only samples in: "
            f"group them by kind), or train with tp=N or in one process"
        )


def local_inputs(inputs: Any, topology: Topology, microbatches: int) -> Any:
    """This rank's contiguous share of a global batch of inputs alone (prediction),
    after checking it divides over the data-parallel ranks and `microbatches`."""
    size = batch_size(inputs, "inputs")
    check_batch_divides(size, topology, microbatches)
    return _share(inputs, topology, size)


def _share(tree: Any, topology: Topology, size: int) -> Any:
    if topology.dp_size == 1:
        return tree
    share = topology.local_batch(size)
    start = topology.dp_rank * share
    return slice_batch(tree, start, start + share)
