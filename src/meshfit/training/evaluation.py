"""Evaluation during a run: when it is due, and the token- or sample-mean loss over the
evaluation set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from meshfit.data.reading import Reading
from meshfit.data.sampling import GlobalBatchSampler, StreamShare
from meshfit.engine import Engine
from meshfit.runtime.batch_errors import first_batch_explained


def eval_schedule(
    eval_data: Any, batch_size: int, eval_batches: int | None, eval_every: int | None, epochs: Any
) -> str:
    """When the run evaluates, and on what, in words, for the start-up lines."""
    if isinstance(eval_data, IterableDataset):
        size = f"{eval_batches} global batches of a stream"
    else:
        batches = len(eval_data) // batch_size
        size = f"{min(batches, eval_batches or batches) * batch_size} samples"
    if eval_every is not None:
        when = f"every {eval_every} steps and at the end"
    elif epochs is not None:
        when = "at the end of every epoch"
    else:
        when = "at the end of the run (pass eval_every=N to evaluate during training)"
    return f"evaluating on {size} {when}"


def is_due(step: int, every: int | None, at_end: bool) -> bool:
    """Whether a periodic job (eval, checkpoint) runs at `step`: every N steps and at the end."""
    return at_end or bool(every and step % every == 0)


@torch.no_grad()
def evaluation_loss(
    engine: Engine,
    data: Dataset,
    batch_size: int,
    limit: int | None,
    workers: int,
    reading: Reading,
) -> tuple[float, dict[str, float]]:
    """The eval loss over up to `limit` global batches (for a (sum, count) loss, every
    language model's, the mean over all their counted items, as one batch of them all
    would give; for a mean loss, the mean of the equal batches' means), and each
    metric's mean over the batches ("eval_<name>")."""
    if isinstance(data, IterableDataset):
        share = StreamShare(
            data, batch_size, dp_size=engine.dp_size, dp_rank=engine.dp_rank, stop_step=limit
        )
        loader = DataLoader(
            share, batch_size=engine.topology.local_batch(batch_size), collate_fn=reading.collate_fn
        )
    else:
        sampler = GlobalBatchSampler(
            len(data), batch_size, dp_size=engine.dp_size, dp_rank=engine.dp_rank, shuffle=False
        )
        if limit is not None:
            sampler.stop_step = min(sampler.stop_step, limit)
        loader = DataLoader(
            data,
            batch_sampler=sampler,
            collate_fn=reading.collate_fn,
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )
    batches = first_batch_explained(loader, "eval_dataset")
    losses, counts, metrics = [], [], []
    for batch in batches:
        losses.append(engine.evaluate_local(*engine.split_batch(reading.pick(batch))))
        counts.append(engine.last_eval_count)
        metrics.append(engine.last_metrics)
    names = list(metrics[0]) if metrics else []
    loss = torch.stack(losses).double()
    if counts and all(c is not None for c in counts):  # weigh each batch by its items
        items = torch.stack(counts).double().to(loss.device)
        loss = (loss * items).sum() / items.sum().clamp_min(1)
    # one read from the device
    means = torch.stack(
        [loss.mean()] + [torch.stack([m[n] for m in metrics]).mean() for n in names]
    ).tolist()
    return means[0], {f"eval_{n}": v for n, v in zip(names, means[1:], strict=True)}
