"""Apply a Plan to a model, every form in one fixed order.

The order is the one that composes in PyTorch (as in torchtitan's parallelize):
tensor parallel, then activation checkpointing, then sharded/replicated data parallel,
then pipeline stages. This version builds dp; the other forms are refused by
Plan.check_implemented before we get here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfit.parallel.data import apply_data_parallel
from meshfit.plan import Plan


def apply_plan(
    model: nn.Module, plan: Plan, mesh: DeviceMesh | None, device: torch.device
) -> nn.Module:
    """Return the model, moved to `device` and parallelized as `plan` says."""
    model = model.to(device)
    if mesh is None:  # one process: nothing to split
        return model
    if plan.dp and plan.dp > 1:
        model = apply_data_parallel(model, mesh, device)
    return model
