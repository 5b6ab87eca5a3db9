"""Sharded data parallel: FSDP2 (`fully_shard`) per block, then the whole model.

Each repeated block is its own FSDP unit (its parameters are gathered just before it runs
and freed after), the root unit holds the rest (embeddings, head). Gradients are
reduce-scattered and averaged over the fsdp ranks, so each rank keeps 1/N of the
parameters, gradients and optimizer state: ZeRO-3. With bf16 precision, compute runs in
bf16 on gathered bf16 copies while the sharded master weights, gradient reduction and
optimizer stay fp32.

The same units serve replicated data parallel where DDP cannot (tensor-parallel DTensor
parameters, offload): given a ("dp", "fsdp") mesh FSDP2 replicates over "dp" and shards
over "fsdp" (HSDP), with "fsdp" of size 1 for plain replicas.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks
from meshfit.plan import Plan


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 works over: ("dp", "fsdp") when there are replicas, else "fsdp"."""
    names = mesh.mesh_dim_names or ()
    return mesh["dp", "fsdp"] if "dp" in names else mesh["fsdp"]


def _options(plan: Plan, device: torch.device) -> dict:
    """fully_shard's keyword arguments for `plan`: precision, resharding, offload."""
    return {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if plan.precision == "bf16" else None,
            # bf16 compute reduces fp32 gradients; otherwise reduce in the parameters'
            # own dtype (float32 here would round a float64 model's gradients).
            reduce_dtype=torch.float32 if plan.precision == "bf16" else None,
        ),
        "reshard_after_forward": plan.reshard_after_forward,
        "offload_policy": _offload_policy(plan.offload, device),
    }


def _offload_policy(offload: bool, device: torch.device) -> OffloadPolicy:
    if not offload:
        return OffloadPolicy()
    if device.type == "cpu":
        # Nothing to move: CPU workers keep everything in host memory already (and
        # FSDP2's CPUOffloadPolicy needs an accelerator to copy to and from).
        warnings.warn(
            "offload=True changes nothing on CPU workers: parameters, gradients and "
            "optimizer state are in CPU memory already",
            stacklevel=3,
        )
        return OffloadPolicy()
    return CPUOffloadPolicy()


def shard_modules(
    modules: list[nn.Module], mesh: DeviceMesh, plan: Plan, device: torch.device
) -> None:
    """Make each module its own FSDP unit, with no unit around them in the user's model:
    a pipeline stage leaves the model's forward early, so a root there would never run
    its after-forward step. The root goes on the stage module instead (`shard_stage`),
    whose forward returns normally."""
    options = _options(plan, device)
    for module in modules:
        if any(True for _ in module.parameters()):
            fully_shard(module, mesh=mesh, **options)


def shard_stage(stage: nn.Module, mesh: DeviceMesh, plan: Plan, device: torch.device) -> nn.Module:
    """An FSDP root over a pipeline stage's module, above the units `shard_modules` made
    (registered as its submodules; it holds no parameters of its own). The pipeline
    schedule sees an FSDP module and then reduce-scatters once per step, after the last
    micro-batch, and keeps parameters gathered from one backward to the next, instead
    of both in every micro-batch: the demo GPT under fsdp=2,pp=2 sent 8.1 MB per rank
    and step with 2 micro-batches and 29.2 MB with 8 before, 5.4 and 10.7 now
    (BENCHMARKS.md). Without registered units, left as it is."""
    if not hasattr(stage, "units"):
        return stage
    fully_shard(stage, mesh=mesh, **_options(plan, device))
    return stage


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, plan: Plan, device: torch.device) -> nn.Module:
    """Shard `model` over `mesh`: one FSDP unit per repeated block, one root unit.

    Under ZeRO-3 (reshard_after_forward=True) two units stay gathered from forward to
    backward, as torchtitan does: the last block, whose backward comes right after the
    head's, and the root, left to FSDP2's own default for it (not resharded). Gathering
    them again would send their parameters once more per step for a moment's memory:
    the demo GPT under fsdp=2 sent 7.024 MB per rank and step, now 6.461
    (benchmarks/data_parallel.py, BENCHMARKS.md)."""
    options = _options(plan, device)
    try:
        blocks = find_blocks(model).blocks
    except MeshfitError:
        blocks = []  # no repeated unit: one FSDP unit for the whole model
    for block in blocks[:-1]:
        fully_shard(block, mesh=mesh, **options)
    if blocks:
        fully_shard(blocks[-1], mesh=mesh, **{**options, "reshard_after_forward": False})
    root_options = dict(options)
    if plan.reshard_after_forward:
        # Omitted, FSDP2 keeps the root gathered after forward (torch >= 2.6); an
        # explicit True would reshard it (torch 2.13 honours the flag for the root).
        del root_options["reshard_after_forward"]
    fully_shard(model, mesh=mesh, **root_options)
    return model
