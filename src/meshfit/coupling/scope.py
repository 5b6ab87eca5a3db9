"""Where the samples of a batch meet: the scope a training step's forward and loss run in.

Data parallelism is exact when a batch's loss is the mean of its samples' losses: then
each rank may take a share. A loss that couples samples (a contrastive loss over
in-batch pairs, a mixture of experts' load-balancing loss over its router's statistics)
must instead see the whole global batch. meshfit makes such a loss global where the
samples meet: the rows a loss pairs are gathered from every rank that holds a share of
the batch (`gather_rows`), the statistics it sums are summed over them (`sum_over`).

Why the gradients come out exact: every rank then computes the same global loss L. The
gather's backward sums the gradient that each rank's copy of L sends to a row, so the
rank that owns the row receives W times dL/d(row) (W ranks); DDP and FSDP2 average the
parameter gradients over the W ranks, which divides the W back out. An all-reduce with
a summing backward gives the same for summed statistics.

With M micro-batches per rank the samples that run together are one round of them (the
m-th micro-batch of every rank): a coupled loss is formed per round and averaged over
the rounds, as one process training with microbatches=M computes it on the global
batch with its rows ordered round by round (docs/guide.md, "Losses that couple the
samples of a batch").

The scope is a stack (a step inside a step cannot happen, but the coupling probe runs
its own scope); `current()` is None outside a meshfit step: the helpers then return
their input, as one process would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshfit.parallel.collectives import SumOver, gather_objects, gather_with_grad


@dataclass
class Scope:
    """How the samples of the running micro-batch meet those of the other ranks.

    groups: the process groups the global batch is split over, outermost first (dp,
        then fsdp: the order of the ranks' shares in the global batch).
    sum_groups: those a summed statistic is summed over: the batch's, and context
        parallel's (each of its ranks holds a part of every sequence's tokens).
    rows: the samples of this rank's running micro-batch (in-batch products are found
        by it).
    aux_scale: what a load-balancing loss is multiplied by so that meshfit's (sum,
        count) normalisation of a model's own token loss leaves it as the model wrote it
        (coupling/moe.py); 1 otherwise.
    products: gather the operands of in-batch products (coupling/products.py).
    replay: the coupling probe's record of a whole batch, replayed into its halves
        (coupling/probe.py); None in a real step.
    pipeline: the loss runs on a pipeline's last stage, which holds only its own blocks.
    """

    groups: list[dist.ProcessGroup] = field(default_factory=list)
    sum_groups: list[dist.ProcessGroup] = field(default_factory=list)
    rows: int | None = None
    aux_scale: torch.Tensor | float = 1.0
    products: bool = False
    replay: Any = None
    pipeline: bool = False
    # the model's own loss function formed over the global batch: how each of its
    # arguments holds the samples (coupling/own_loss.py); None: as the model calls it
    own_loss: Any = None
    # what met: names of the couplings made global in this scope ("in-batch products",
    # "load-balancing loss", "mf.gather_batch", "mf.batch_sum"), for the start-up note
    met: set[str] = field(default_factory=set)


_STACK: list[Scope] = []


def current() -> Scope | None:
    """The scope of the running step, or None outside a meshfit step."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def active(scope: Scope) -> Iterator[Scope]:
    _STACK.append(scope)
    try:
        yield scope
    finally:
        _STACK.pop()


def gather_rows(x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    """`x`'s rows (along `dim`) from every rank of the scope's batch groups, in the order
    of the global batch, the gradient of each row flowing back to the rank that holds it
    (summed over the ranks whose loss read it). Outside a scope: `x`."""
    scope = current()
    if scope is None:
        return x
    scope.met.add(what)
    if scope.replay is not None:
        return scope.replay.rows(x, dim)
    # inner group first: the outer group's ranks then hold consecutive blocks of rows
    for group in reversed(scope.groups):
        x = gather_with_grad(x, dim, group)
    return x


def gather_items(items: list, what: str) -> list:
    """A list of one item per sample (each image's boxes) from every rank of the
    scope's batch groups, in the order of the global batch (targets: no gradients).
    Outside a scope: `items`."""
    scope = current()
    if scope is None:
        return items
    scope.met.add(what)
    if scope.replay is not None:
        return scope.replay.items(items)
    for group in reversed(scope.groups):
        items = gather_objects(items, group)
    return items


def sum_over(x: torch.Tensor, what: str) -> torch.Tensor:
    """`x` summed over the scope's loss groups (the batch's and the sequence's), its
    gradient summed back to every rank. Outside a scope: `x`."""
    scope = current()
    if scope is None:
        return x
    scope.met.add(what)
    if scope.replay is not None:
        return scope.replay.total(x)
    for group in scope.sum_groups:
        x = SumOver.apply(x, group)
    return x
