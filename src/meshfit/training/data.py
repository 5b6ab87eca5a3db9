"""The run's data: datasets made from what the user gave, the held-out split, the loader of
this rank's share of each global batch, the example batch the forms get.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from meshfit.data.columns import as_columns
from meshfit.data.reading import Reading
from meshfit.data.sampling import GlobalBatchSampler, StreamShare
from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.runtime.batches import split_batch
from meshfit.training.resume import RunConfig


def hold_out(data: Dataset, fraction: Any, eval_data: Dataset | None) -> tuple[Dataset, Dataset]:
    """Keras' validation_split: the LAST `fraction` of the samples, before any shuffling,
    become the evaluation set; the rest is trained on."""
    if eval_data is not None:
        raise MeshfitError("give eval_dataset or validation_split, not both")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise MeshfitError(
            f"validation_split must be a fraction between 0 and 1, e.g. 0.1, not {fraction!r}"
        )
    n = len(data)
    held = int(n * fraction)
    if held == 0 or held == n:
        raise MeshfitError(
            f"validation_split={fraction} of {n} samples leaves {held} for evaluation and "
            f"{n - held} for training; use a fraction that leaves samples on both sides"
        )
    return Subset(data, range(n - held)), Subset(data, range(n - held, n))


def train_loader(
    data: Dataset,
    engine: Engine,
    config: RunConfig,
    start_step: int,
    stop_step: int,
    workers: int,
    reading: Reading,
) -> DataLoader:
    """This rank's share of each global batch from `start_step` up to `stop_step`."""
    if isinstance(data, IterableDataset):
        share = StreamShare(
            data,
            config.batch_size,
            dp_size=engine.dp_size,
            dp_rank=engine.dp_rank,
            start_step=start_step,
            stop_step=stop_step,
        )
        return DataLoader(
            share,
            batch_size=engine.topology.local_batch(config.batch_size),
            collate_fn=reading.collate_fn,
            pin_memory=engine.device.type == "cuda",
        )
    sampler = GlobalBatchSampler(
        config.num_samples,
        config.batch_size,
        dp_size=engine.dp_size,
        dp_rank=engine.dp_rank,
        seed=config.seed,
        start_step=start_step,
        stop_step=stop_step,
        shuffle=config.shuffle,
    )
    return DataLoader(
        data,
        batch_sampler=sampler,
        collate_fn=reading.collate_fn,
        num_workers=workers,
        pin_memory=engine.device.type == "cuda",
        # Its own generator: a DataLoader otherwise draws a seed from the global RNG when
        # it starts, which would shift the model's dropout stream after a resume.
        generator=torch.Generator().manual_seed(config.seed),
    )


def as_dataset(data: Any, what: str) -> Dataset:
    """A map-style Dataset from a Dataset, an (inputs, targets) pair of columns (tensors,
    numpy arrays, lists, or dicts of them) or one dict of columns (data/columns.py)."""
    if isinstance(data, IterableDataset):
        return data  # a stream (data/sampling.StreamShare reads it)
    columns = as_columns(data, what)  # (x, y) as tensors, arrays, lists or dicts of them
    if columns is not None:
        return columns
    if (
        isinstance(data, (tuple, list))
        and len(data) != 2
        and data
        and all(isinstance(t, torch.Tensor) for t in data)
    ):
        raise MeshfitError(
            f"{what} is a {type(data).__name__} of {len(data)} tensors; give the pair "
            f"(inputs, targets), or a Dataset of (inputs, targets) samples"
        )
    if isinstance(data, Dataset) or (
        hasattr(data, "__getitem__")
        and hasattr(data, "__len__")
        and not isinstance(data, (str, bytes))
    ):
        return data
    raise MeshfitError(
        f"{what} must be a torch Dataset of (inputs, targets) samples or a pair of "
        f"tensors (inputs, targets), not {type(data).__name__}"
    )


def first_samples(data: Dataset, reading: Reading, loss_fn: Any) -> Callable[[int], Any]:
    """n -> the first n samples of `data` as one (inputs, targets) batch, as the loader
    collates them (None for an empty dataset): the example the planner and the forms
    are shown (prepare.Examples)."""

    def first(n: int) -> tuple[Any, Any] | None:
        samples = (
            list(itertools.islice(iter(data), n))
            if isinstance(data, IterableDataset)
            else [data[i] for i in range(min(len(data), n))]
        )
        if not samples:
            return None
        return split_batch(reading.pick(reading.collate_fn(samples)), loss_fn == "model")

    return first


def real_tokens(inputs: Any, targets: Any) -> torch.Tensor | int | None:
    """This rank's real tokens in a step: where the attention mask is 1, else where the
    integer targets are not -100 (ignored), else every token id of [batch, seq] integer
    inputs; None when the batch holds no tokens."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if not isinstance(ids, torch.Tensor) or ids.ndim < 2 or ids.is_floating_point():
        return None  # not token ids (an image batch, features)
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if isinstance(mask, torch.Tensor) and not mask.is_floating_point():
        return mask.sum()
    if isinstance(targets, torch.Tensor) and targets.ndim >= 2 and not targets.is_floating_point():
        return (targets != -100).sum()
    return ids.numel()
