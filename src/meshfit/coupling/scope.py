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


@dataclass
class Scope:
    """How the samples of the running micro-batch meet those of the other ranks.

    groups: the process groups the global batch is split over, outermost first (dp,
        then fsdp: the order of the ranks' shares in the global batch).
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
    rows: int | None = None
    aux_scale: torch.Tensor | float = 1.0
    products: bool = False
    replay: Any = None
    pipeline: bool = False
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
        x = _gather(x, dim, group)
    return x


def sum_over(x: torch.Tensor, what: str) -> torch.Tensor:
    """`x` summed over the scope's batch groups, its gradient summed back to every rank.
    Outside a scope: `x`."""
    scope = current()
    if scope is None:
        return x
    scope.met.add(what)
    if scope.replay is not None:
        return scope.replay.total(x)
    for group in scope.groups:
        x = _SumOver.apply(x, group)
    return x


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` of every rank of `group`, concatenated along `dim`, the gradient of each part
    summed over the ranks and returned to the part's rank."""
    dim = dim % x.ndim
    moved = x.movedim(dim, 0) if dim else x
    gathered = _GatherRows.apply(moved, group)
    return gathered.movedim(0, dim) if dim else gathered


class _GatherRows(torch.autograd.Function):
    """torch's all-gather with a summing backward (an all-reduce of the gradient, then
    this rank's rows). torch.distributed.nn's autograd all_gather does the same but is
    deprecated in torch 2.13, and the functional collectives' autograd variant is
    private and reduce-scatters, which gloo (CPU workers) does not run."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.rows, ctx.rank = group, x.shape[0], dist.get_rank(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()  # the all-reduce writes in place
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total.narrow(0, ctx.rank * ctx.rows, ctx.rows), None


class _SumOver(torch.autograd.Function):
    """torch's all-reduce (sum) with a summing backward: every rank's loss read the total,
    so each rank's part receives the sum of their gradients (torch.distributed.nn's
    autograd all_reduce, deprecated in torch 2.13, did the same)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None
