"""BatchNorm over the global batch: what one process computes, under data parallel.

A BatchNorm layer normalises with its batch's statistics. Under dp or fsdp each rank
sees only its share of the batch, so left alone every rank normalises with its own
statistics and trains another run than one process (measured on a small CNN under
dp=2: the loss 10% apart from the first step). meshfit makes every BatchNorm layer of
the model compute its statistics over the ranks the batch is split over (SyncBatchNorm
semantics), in training; evaluation uses the running statistics, which are then the
same on every rank.

On CUDA this is torch's `nn.SyncBatchNorm` (its fused kernels). Elsewhere torch's has
no kernels (`aten::batch_norm_stats` is not implemented for CPU, torch 2.13), so
meshfit computes the same statistics with two small all-reduces per layer (`_SumOver`:
an all-reduce whose backward sums the statistics' gradients over the ranks, the
gradient one process gets; torch's own, `torch.distributed.nn.functional.all_reduce`,
is deprecated in 2.13 and warns on every call).

Micro-batches split the batch too: each micro-batch is normalised on its own (what
gradient accumulation does), which no synchronisation over ranks can undo, so a
BatchNorm model with more than one micro-batch is refused unless the user opts out (a
pipeline plan that leaves micro-batches and schedule open gets one micro-batch under
GPipe instead: prepare.one_microbatch_for_batchnorm).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from meshfit.errors import MeshfitError

OPT_OUT = (
    "sync_batchnorm=False lets each rank and micro-batch normalise with its own "
    "statistics (faster, no communication, but not the one-process run)"
)


def batchnorm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers that use batch statistics in training."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]


def refuse_unsynchronisable(model: nn.Module, batch_parts: int) -> None:
    """Keras's BatchNormalization computes its statistics with Keras ops that meshfit
    cannot reach: refuse it when the batch is split (over ranks or micro-batches)."""
    for layer in _keras_layers(model):
        kind = type(layer)
        if kind.__name__ == "BatchNormalization" and kind.__module__.startswith("keras"):
            if batch_parts > 1:
                raise MeshfitError(
                    f"layer {layer.name!r} is a Keras BatchNormalization, whose batch statistics "
                    f"meshfit cannot compute over the whole batch once it is split over "
                    f"{batch_parts} ranks x micro-batches (each part would be normalised "
                    f"on its own: not the one-process run); train it in one process, or "
                    f"{OPT_OUT}"
                )


def _keras_layers(model: nn.Module) -> list[object]:
    """A Keras model's layers, nested models included (Keras keeps them in `layers`
    lists, not as torch sub-modules); nothing for other models."""
    found, todo = [], [model]
    while todo:
        layer = todo.pop()
        found.append(layer)
        children = (
            getattr(layer, "layers", None) if type(layer).__module__.startswith("keras") else None
        )
        if isinstance(children, list):
            todo.extend(children)
    return found


def refuse_microbatches(model: nn.Module, microbatches: int, pp: int = 1) -> None:
    """Micro-batches are normalised one by one: refuse, naming the whole fix (under pp
    one micro-batch needs the schedule that runs one: GPipe)."""
    layers = batchnorm_layers(model)
    if layers and microbatches > 1:
        fix = (
            "microbatches=1,schedule='gpipe' in the plan (or leave both out)"
            if pp > 1
            else "microbatches=1"
        )
        raise MeshfitError(
            f"layer {layers[0][0]!r} is a {type(layers[0][1]).__name__} and the plan cuts each "
            f"rank's batch into "
            f"{microbatches} micro-batches, which BatchNorm would normalise one by one (not "
            f"the one-process run); use {fix}, or {OPT_OUT}"
        )


def synchronise_batchnorm(
    model: nn.Module, groups: list[dist.ProcessGroup], device: torch.device
) -> nn.Module:
    """Make every BatchNorm layer of `model` normalise over the ranks of `groups` (the
    batch's data-parallel groups). Returns the model (the same object unless the model
    itself is a BatchNorm layer and torch's SyncBatchNorm replaced it)."""
    if not groups or not batchnorm_layers(model):
        return model
    if device.type == "cuda" and len(groups) == 1:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=groups[0])
    sizes = [dist.get_world_size(g) for g in groups]
    for _, layer in batchnorm_layers(model):
        # The layer keeps its class, names and state; only its forward changes.
        layer.forward = types.MethodType(_global_batch_forward(groups, math.prod(sizes)), layer)
    return model


def _global_batch_forward(groups: list[dist.ProcessGroup], ranks: int):
    def forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.running_mean is not None:  # running statistics
            return type(self).forward(self, x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # Every rank holds an equal share of the batch (meshfit splits it evenly).
        over, parts = ([], 1) if _ALONE[0] else (groups, ranks)  # local_statistics()
        count = x.numel() // x.shape[1] * parts
        mean = _sum_over(x.sum(dims), over) / count
        centred = x - mean.view(shape)
        var = _sum_over((centred * centred).sum(dims), over) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        return y

    return forward


_ALONE = [False]  # local_statistics(): no rank waits for the others


@contextlib.contextmanager
def local_statistics(model: nn.Module) -> Iterator[None]:
    """Inside: `model`'s synchronised BatchNorm layers use this rank's statistics alone
    (torch's SyncBatchNorm, on CUDA, its running ones). For a forward that only one
    rank runs (the pipeline cut counts FLOPs on rank 0 and broadcasts the cut): its
    peers never join the all-reduce, which waited forever (dp=2,pp=2 on a ResNet)."""
    synced = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm) and m.training]
    _ALONE[0] = True
    for layer in synced:
        layer.train(False)
    try:
        yield
    finally:
        _ALONE[0] = False
        for layer in synced:
            layer.train(True)


def _sum_over(tensor: torch.Tensor, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    for group in groups:
        tensor = _SumOver.apply(tensor, group)
    return tensor


class _SumOver(torch.autograd.Function):
    """Sum over the ranks of `group`; the gradient of every rank's input is the sum of
    the ranks' output gradients (each rank's loss depends on every rank's input)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
