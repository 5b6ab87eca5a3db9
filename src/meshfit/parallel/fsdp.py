"""Sharded data parallel: FSDP2 (`fully_shard`) per block, then the whole model.

Each repeated block is its own FSDP unit (its parameters are gathered just before it runs
and freed after), the root unit holds the rest (embeddings, head). Gradients are
reduce-scattered and averaged over the fsdp ranks, so each rank keeps 1/N of the
parameters, gradients and optimizer state: ZeRO-3. With bf16 precision, compute runs in
bf16 on gathered bf16 copies while the sharded master weights, gradient reduction and
optimizer stay fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks


def _policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "fp16":
        raise MeshfitError(
            "precision='fp16' (gradient scaling) is not supported with fsdp; use 'bf16'"
        )
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )


def shard_modules(modules: list[nn.Module], mesh: DeviceMesh, *, precision: str) -> None:
    """Make each module its own FSDP unit, with no unit around them all: for a pipeline
    stage, whose forward is left early, so a root unit's after-forward step would not run."""
    policy = _policy(precision)
    for module in modules:
        if any(True for _ in module.parameters()):
            fully_shard(module, mesh=mesh, mp_policy=policy)


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, precision: str, reshard_after_forward: bool = True
) -> nn.Module:
    """Shard `model` over `mesh` (its "fsdp" dimension). reshard_after_forward=False
    keeps each block's parameters gathered from forward to backward (ZeRO-2-like: less
    communication, more memory)."""
    policy = _policy(precision)
    try:
        stack = find_blocks(model)
        blocks = stack.blocks
    except MeshfitError:
        blocks = []  # no repeated unit: one FSDP unit for the whole model
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model
