"""Which samples each rank reads at each step.

Every step's global batch is the same whatever the plan: one seeded permutation per
epoch, cut into consecutive global batches; each data-parallel rank takes a contiguous,
equal share. So a dp=4 run reads exactly the samples a single process reads, and a
resumed run continues from the step it stopped at, with nothing skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import IterableDataset, Sampler


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for steps `start_step` .. `stop_step - 1`, this rank's sample indices.

    The last incomplete global batch of each epoch is dropped so every step sees a full
    batch (a short batch would change the loss average and break equivalence).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        dp_size: int,
        dp_rank: int,
        seed: int = 0,
        start_step: int = 0,
        stop_step: int | None = None,
        shuffle: bool = True,
    ) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.share = batch_size // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = num_samples // batch_size
        self.start_step = start_step
        self.stop_step = stop_step if stop_step is not None else self.steps_per_epoch

    def __len__(self) -> int:
        return max(0, self.stop_step - self.start_step)

    def __iter__(self) -> Iterator[list[int]]:
        cached_epoch, permutation = -1, None
        for step in range(self.start_step, self.stop_step):
            epoch, index = divmod(step, self.steps_per_epoch)
            if epoch != cached_epoch:
                cached_epoch = epoch
                permutation = epoch_permutation(self.num_samples, self.seed, epoch, self.shuffle)
            begin = index * self.batch_size + self.dp_rank * self.share
            yield permutation[begin : begin + self.share].tolist()


class StreamShare(IterableDataset):
    """This rank's share of each global batch of a stream (an IterableDataset, read in
    its own order): every rank reads the whole stream, cuts it into global batches of
    `batch_size` samples and keeps its contiguous share of each, so a dp=4 run trains
    on exactly the batches one process would. A resumed run skips the `start_step`
    batches already trained; the last incomplete batch is dropped, on every rank alike
    (a batch is buffered whole before this rank's share of it is given out)."""

    def __init__(
        self,
        stream: Iterable,
        batch_size: int,
        *,
        dp_size: int,
        dp_rank: int,
        start_step: int = 0,
        stop_step: int | None = None,
    ) -> None:
        self.stream = stream
        self.batch_size = batch_size
        self.share = batch_size // dp_size
        self.dp_rank = dp_rank
        self.start_step = start_step
        self.stop_step = stop_step

    def __iter__(self) -> Iterator:
        step, batch = 0, []
        mine = slice(self.dp_rank * self.share, (self.dp_rank + 1) * self.share)
        for sample in self.stream:
            if self.stop_step is not None and step >= self.stop_step:
                return
            batch.append(sample)
            if len(batch) < self.batch_size:
                continue
            if step >= self.start_step:
                yield from batch[mine]
            step, batch = step + 1, []
