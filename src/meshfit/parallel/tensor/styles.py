"""The ParallelStyles torch does not have (HF's Conv1D and fused q|k|v split chunk by
chunk; experts' weight parameters) and Megatron's f / g autograd functions they run on
local shards with.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ParallelStyle,
)

from meshfit.parallel.tensor.split import _is_conv, _is_conv1d
from meshfit.trees import map_tensors


def _summing(inner: Any, group: Any) -> Any:
    """`inner` (a forward of (module, ...)) run with its module's `_tp_summed_gradients`
    parameters seen through _CopyToTP."""

    @functools.wraps(inner)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        held = {n: self._parameters[n] for n in self._tp_summed_gradients}
        try:
            for n, p in held.items():
                self._parameters[n] = _CopyToTP.apply(p, group)
            return inner(self, *args, **kwargs)
        finally:
            self._parameters.update(held)

    return forward


def _summing_inputs(inner: Any, group: Any) -> Any:
    """`inner` (a forward of (module, ...)) with its floating-point inputs seen through
    _CopyToTP: a whole layer each rank runs for its own heads (multi-query attention's
    k and v) gives each rank a part of its input's gradient, summed over the tp ranks
    as a column-parallel layer's is."""

    @functools.wraps(inner)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = map_tensors(
            (args, kwargs), lambda t: _CopyToTP.apply(t, group) if t.is_floating_point() else t
        )
        return inner(self, *args, **kwargs)

    return forward


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the input's gradient summed over the tp ranks
    (each rank's column slice contributes its part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the row-parallel partial products summed over the tp ranks; the
    gradient passes through (it is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _LocalShard(ParallelStyle):
    """Column- or row-parallel for what torch's styles do not take: HF's Conv1D (weight
    stored (in, out)), convolutions (split over output / input channels, the same
    weight dimensions as a Linear's features), and fused projections whose output is N chunks (q|k|v) each
    split over the ranks. A fused weight is a DTensor with `_StridedShard(dim, N)`: rank
    r holds [q_r, k_r, v_r], and its full tensor is the one-process layout, so gathered
    state dicts keep it. The forward runs on the local shards with Megatron's f / g."""

    def __init__(self, style: str, chunks: int = 1) -> None:
        super().__init__()
        self.style, self.chunks = style, chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        conv1d = _is_conv1d(module)
        out_dim = 1 if conv1d else 0  # the weight dimension of the output features
        col = self.style == "colwise"
        dim = out_dim if col else 1 - out_dim

        def placement(d: int):
            return _StridedShard(d, split_factor=self.chunks) if self.chunks > 1 else Shard(d)

        w = module.weight
        module.weight = nn.Parameter(
            distribute_tensor(w.data, device_mesh, [placement(dim)]), w.requires_grad
        )
        bias = getattr(module, "bias", None)
        if bias is not None:
            layout = [placement(0)] if col else [Replicate()]
            module.bias = nn.Parameter(
                distribute_tensor(bias.data, device_mesh, layout), bias.requires_grad
            )
        group = device_mesh.get_group()
        conv = _is_conv(module)

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight.to_local()
            b = module.bias.to_local() if module.bias is not None else None
            if col:
                x = _CopyToTP.apply(x, group)
            if conv:  # its own padding and stride; a column split's bias added inside
                y = module._conv_forward(x, weight, b if col else None)
                if col:
                    return y
                if b is not None:
                    b = b.view(-1, *[1] * (weight.ndim - 2))  # per channel: (C, 1, 1)
            else:
                y = x @ weight if conv1d else x @ weight.t()
            if not col:
                y = _ReduceFromTP.apply(y, group)
            return y if b is None else y + b

        module.forward = forward
        return module

    def __repr__(self) -> str:
        chunks = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return f"_LocalShard({self.style}{chunks})"


class _ChannelShard(ParallelStyle):
    """A per-channel layer (BatchNorm) between a column-parallel convolution and its
    row-parallel partner, split by channel with them: its weight, bias and running
    statistics sharded on dim 0, its own forward run on the local channels. Each rank
    normalises its channels over the whole batch, as one process does: no
    communication, and the running statistics stay exact (each rank updates its own)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        for name, p in list(module._parameters.items()):
            if p is not None:
                sharded = distribute_tensor(p.data, device_mesh, [Shard(0)])
                module._parameters[name] = nn.Parameter(sharded, p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.ndim == 1:  # not num_batches_tracked
                module._buffers[name] = distribute_tensor(b, device_mesh, [Shard(0)])
        original = module.forward
        params = tuple(n for n, p in module._parameters.items() if p is not None)

        def forward(*args: Any, **kwargs: Any) -> Any:
            held = dict(module._buffers)
            try:
                with torch.no_grad():  # updated in place: the local tensors themselves
                    for n, b in held.items():
                        if isinstance(b, DTensor):
                            module._buffers[n] = b._local_tensor
                with _local_weights(module, params):
                    return original(*args, **kwargs)
            finally:
                module._buffers.update(held)

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return "_ChannelShard()"


class _WeightShard(ParallelStyle):
    """Megatron's split of the weight parameters a module multiplies itself (a mixture of
    experts' 3-D gate_up_proj and down_proj): each named weight sharded on its output
    features (column-parallel; chunk by chunk for a fused gate|up, so each rank keeps
    matching halves of gate and of up) or its input features (row-parallel). The
    module's own forward runs on the local shards: its floating-point inputs through f
    (their gradients summed over the tp ranks), the outputs holding its row-parallel
    products through g. One all-reduce after all experts, in forward and in backward."""

    def __init__(self, weights: dict[str, tuple[str, int, int]], reduce: tuple[int, ...]) -> None:
        super().__init__()
        self.weights, self.reduce = weights, reduce  # {name: (style, dim, chunks)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        for name, (_, dim, chunks) in self.weights.items():
            w = getattr(module, name)
            layout = _StridedShard(dim, split_factor=chunks) if chunks > 1 else Shard(dim)
            sharded = distribute_tensor(w.data, device_mesh, [layout])
            setattr(module, name, nn.Parameter(sharded, w.requires_grad))
        group, names, reduce = device_mesh.get_group(), tuple(self.weights), set(self.reduce)
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = map_tensors(
                (args, kwargs),
                lambda t: _CopyToTP.apply(t, group) if t.is_floating_point() else t,
            )
            with _local_weights(module, names):
                out = original(*args, **kwargs)
            position = itertools.count()

            def summed(t: torch.Tensor) -> torch.Tensor:
                if not t.is_floating_point():
                    return t
                return _ReduceFromTP.apply(t, group) if next(position) in reduce else t

            return map_tensors(out, summed)

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return f"_WeightShard({self.weights})"


@contextlib.contextmanager
def _local_weights(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """`module`'s sharded weights `names` seen by its forward as their local shards
    (differentiable: the gradient reaches the sharded parameter), read at call time so
    FSDP2's unsharded parameters are the ones used."""
    held = {n: module._parameters[n] for n in names}
    try:
        for n, p in held.items():
            module._parameters[n] = p.to_local() if isinstance(p, DTensor) else p
        yield
    finally:
        module._parameters.update(held)
