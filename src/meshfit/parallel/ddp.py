"""Replicated data parallel: PyTorch's DistributedDataParallel over the replicas' group."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def replicate(
    module: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    pipeline_stage: bool = False,
    ignored: set[nn.Parameter] = frozenset(),
) -> nn.Module:
    """Wrap `module` in DDP over `group` (the data-parallel replicas: Topology's "dp"
    group). DDP broadcasts rank 0's parameters and buffers at construction, so every
    replica starts identical whatever each process's own initialisation was.

    For a pipeline stage (`pipeline_stage=True`), forwards never arm DDP's gradient
    reduction: torch.distributed.pipelining prepares it itself before the last
    micro-batch's backward and runs the others under `no_sync`, but `no_sync` around a
    backward comes too late when a forward outside it armed the reduction already; with
    GPipe, or 1F1B with few micro-batches, every backward after the last forward then
    marked the gradients ready again and DDP failed at the second step ("rebuilt
    parameter indices size is not same as original model parameters size")."""
    device_ids = [device.index] if device.type == "cuda" else None
    options = {}
    if pipeline_stage:
        # A stage module registers its blocks; syncing their buffers from dp rank 0 before
        # every micro-batch's forward would add a collective per micro-batch (torch 2.13
        # names the switch forward_sync_buffers and deprecates broadcast_buffers).
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        options[name] = False
    if ignored:  # expert parallel's parameters: it reduces their gradients itself
        names = [n for n, p in module.named_parameters() if p in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group, **options)
    if pipeline_stage:
        ddp.require_backward_grad_sync = False
    return ddp


@dataclass
class DDPGradientSync:
    """Gradient accumulation under DDP: a deferred micro-batch runs under `no_sync`
    (runners.GradientSync)."""

    model: DistributedDataParallel

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync()
