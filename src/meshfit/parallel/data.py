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
