"""Replicated data parallel: PyTorch's DistributedDataParallel over the mesh's "dp" dim."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap `model` in DDP over `mesh`'s "dp" group. DDP broadcasts rank 0's parameters
    and buffers at construction, so every replica starts identical whatever each
    process's own initialisation was."""
    group = mesh.get_group("dp")
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group)


def apply_data_parallel_to_stage(
    stage: nn.Module, mesh: DeviceMesh, device: torch.device
) -> nn.Module:
    """DDP for one pipeline stage, driven by torch.distributed.pipelining: the schedule
    prepares DDP's gradient reduction itself before the last micro-batch's backward, and
    runs the others under `no_sync`. But `no_sync` around a backward comes too late: a
    DDP forward outside it already armed the reduction, so every backward after the
    last forward marked the gradients ready again. GPipe, and 1F1B with few
    micro-batches, then failed at the second step inside DDP ("rebuilt parameter
    indices size is not same as original model parameters size"). So forwards never
    arm it here, and the one reduction per step is the schedule's."""
    ddp = apply_data_parallel(stage, mesh, device)
    ddp.require_backward_grad_sync = False
    return ddp
