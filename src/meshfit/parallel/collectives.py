"""torch's collectives with the backward a loss over several ranks needs: an all-gather
(`gather_with_grad`) and an all-reduce (`SumOver`) whose backward sums each rank's
gradient and returns it to the rank that holds the value. torch.distributed.nn's autograd
all_gather and all_reduce did the same but are deprecated in torch 2.13, and the
functional collectives' autograd variants are private and reduce-scatter, which gloo (CPU
workers) does not run. Used by coupling/ (the global batch's rows and statistics),
context/ (the sequence's keys and values) and experts.py (tokens to their experts' ranks
and back: `all_to_all`); `gather_objects` gathers a batch's per-sample lists (each
image's boxes) for coupling/own_loss.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshfit.trees import map_tensors, tensors_in


def gather_with_grad(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` of every rank of `group`, concatenated along `dim`, the gradient of each part
    summed over the ranks and returned to the part's rank."""
    dim = dim % x.ndim
    moved = x.movedim(dim, 0) if dim else x
    gathered = _GatherRows.apply(moved, group)
    return gathered.movedim(0, dim) if dim else gathered


def gather_objects(items: list, group: dist.ProcessGroup) -> list:
    """The lists of every rank of `group`, concatenated in rank order: tensors travel on
    the CPU (pickled) and come back on the device they left."""
    found = tensors_in(items)
    device = found[0].device if found else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, map_tensors(items, torch.Tensor.cpu), group=group)
    joined = [item for part in gathered for item in part]
    return joined if device is None else map_tensors(joined, lambda t: t.to(device))


class _GatherRows(torch.autograd.Function):
    """torch's all-gather with a summing backward (an all-reduce of the gradient, then
    this rank's rows)."""

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


class SumOver(torch.autograd.Function):
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


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """torch's all_to_all_single over the rows of `x` (`input_splits[r]` rows to rank r,
    `output_splits[r]` from it), with the backward sending each row's gradient back the
    way it came. torch.distributed.nn's autograd all_to_all did the same and is
    deprecated; the functional collectives' one is private."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return back, None, None, None
