"""Which samples each rank reads at each step.

Every step's global batch is the same whatever the plan: one seeded permutation per
epoch, cut into consecutive global batches; each data-parallel rank takes a contiguous,
equal share. So a dp=4 run reads exactly the samples a single process reads, and a
resumed run continues from the step it stopped at, with nothing skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


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
