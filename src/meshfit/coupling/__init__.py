"""Losses that couple the samples of a batch, made global under every plan.

`mf.gather_batch(x)` and `mf.batch_sum(x)` are the two helpers for a user's own loss;
the rest of the package finds and handles the couplings of the models people bring
(scope.py says how it works and why the gradients are exact; moe.py, products.py;
probe.py finds what it does not handle; batch.py is what the Engine owns).
"""

from __future__ import annotations

import torch

from meshfit.coupling.scope import gather_rows, sum_over


def gather_batch(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`x` for the whole global batch: its rows (along `dim`) from every rank that holds a
    share of the batch, in the batch's order, with gradients flowing back to the rank
    that holds each row (summed over the ranks whose loss read it: exact under DDP and
    FSDP2, which average). For a loss over pairs of samples, e.g. in-batch negatives::

        a, b = mf.gather_batch(a), mf.gather_batch(b)
        loss = F.cross_entropy(a @ b.T / tau, torch.arange(len(a), device=a.device))

    In one process, and outside a meshfit step (prediction, your own code), it returns
    `x`. With M micro-batches per rank it gathers the running round of them (the m-th
    micro-batch of every rank). Every rank must pass the same shape."""
    return gather_rows(x, dim, "mf.gather_batch")


def batch_sum(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over every rank that holds a share of the global batch, with its
    gradient summed back to every rank: for statistics a loss forms over the whole batch
    (per-expert token counts and router probabilities of a load-balancing loss, say).
    In one process and outside a meshfit step it returns `x`."""
    return sum_over(x, "mf.batch_sum")


__all__ = ["batch_sum", "gather_batch"]
