"""Sharded data parallel: FSDP2 (`fully_shard`) per unit, then a root over the part.

Each unit of a model part (a repeated block; for a pipeline stage, also the modules
before / after the blocks that it trains) is its own FSDP unit: its parameters are
gathered just before it runs and freed after. A root unit over the part holds the rest
(embeddings, head). Gradients are reduce-scattered and averaged over the fsdp ranks, so
each rank keeps 1/N of the parameters, gradients and optimizer state: ZeRO-3. With bf16
precision, compute runs in bf16 on gathered bf16 copies while the sharded master
weights, gradient reduction and optimizer stay fp32 (`Precision.fsdp_policy`).

The same units serve replicated data parallel where DDP cannot (tensor-parallel DTensor
parameters, offload): given a ("dp", "fsdp") mesh FSDP2 replicates over "dp" and shards
over "fsdp" (HSDP), with "fsdp" of size 1 for plain replicas.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from meshfit.parallel.head_loss import holds_deferred_head
from meshfit.plan import Plan
from meshfit.runtime.precision import Precision


def shard_part(
    units: list[nn.Module],
    make_module: Callable[[], nn.Module],
    mesh: DeviceMesh,
    plan: Plan,
    precision: Precision,
    device: torch.device,
    *,
    pipeline_stage: bool = False,
    ignored: set[nn.Parameter] = frozenset(),
) -> nn.Module:
    """Make each of `units` (that has parameters) its own FSDP unit, then put a root
    unit over the part's module, made by `make_module` once the units are sharded (a
    stage module lists the parameters sharding replaces). Returns that module.

    Whole model (ZeRO-3, reshard_after_forward=True): two units stay gathered from
    forward to backward, as torchtitan does: the last unit, whose backward comes right
    after the head's, and the root, left to FSDP2's own default for it (an explicit True
    reshards the root too in torch 2.13). Gathering them again sends their parameters
    once more per step: the demo GPT under fsdp=2 sends 6.461 MB per rank and step this
    way, 7.024 MB with both resharded (benchmarks/data_parallel.py).

    Pipeline stage: every unit keeps the plan's flag, and the root goes over the stage
    module when the units are its submodules. torch's pipeline schedule then sees an
    FSDP module and reduce-scatters once per step, after the last micro-batch, instead
    of in every micro-batch (demo GPT, fsdp=2,pp=2, 8 micro-batches: 10.7 MB per rank
    and step; 29.2 MB without the root). The price is memory: until that reduction the
    schedule keeps the whole stage gathered, with its unsharded gradients. With one
    micro-batch nothing is saved by waiting, and the schedule gets the stage behind
    `ReducedPerBlock` instead (Plan.defers_stage_reduction). A unit holding an LM head
    that defers to the loss (chunked_loss) stays gathered after its forward: the schedule
    computes the loss after the stage's forward, and reads the head's weight there. The
    root stays either way:
    units that are their own roots each keep their reduce-scatter's buffer to the end of
    the backward (measured: a rank's memory grew by a whole block per block). pp=2,fsdp=2
    on a 582 MiB Llama, one micro-batch, SGD: 624 MiB per rank at most with the deferral,
    420 MiB with ReducedPerBlock (memory cgroup peaks; tests/test_capped.py). A stage
    module that holds no units (a parameter registered on the model itself) stays as it
    is."""
    options = _options(plan, precision, device)
    scalars = _scalar_parameters(units, make_module) - set(ignored)
    if scalars:
        _average_gradients(scalars, mesh)
    if scalars or ignored:  # `ignored`: expert parallel's, which it reduces itself
        options["ignored_params"] = scalars | set(ignored)
    gathered = {**options, "reshard_after_forward": False}
    sharded = [u for u in _callable(units) if any(True for _ in u.parameters())]
    head_units = [holds_deferred_head(u) for u in sharded]
    for i, (unit, head) in enumerate(zip(sharded, head_units, strict=True)):
        last = i == len(sharded) - 1 and not pipeline_stage
        fully_shard(unit, mesh=mesh, **(gathered if last or head else options))
    module = make_module()
    if pipeline_stage:
        if units and all(_contains(module, u) for u in units):
            head_in_root = not any(head_units) and holds_deferred_head(module)
            fully_shard(module, mesh=mesh, **(gathered if head_in_root else options))
        return module
    if plan.reshard_after_forward:
        del options["reshard_after_forward"]  # FSDP2's root default: kept gathered
    fully_shard(module, mesh=mesh, **options)
    return module


def _callable(units: list[nn.Module]) -> list[nn.Module]:
    """The units, a container among them (a block kept as an nn.ModuleDict of its
    layers, which fully_shard refuses: "containers that do not implement forward")
    replaced by its children, recursively."""
    out: list[nn.Module] = []
    for unit in units:
        if isinstance(unit, (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)):
            out.extend(_callable(list(unit.children())))
        else:
            out.append(unit)
    return out


def _scalar_parameters(
    units: list[nn.Module], make_module: Callable[[], nn.Module]
) -> set[nn.Parameter]:
    """The 0-dim parameters of the part (CLIP's logit_scale): FSDP2 refuses to shard
    them ("fully_shard doesn't support scalar parameters"), and a user's model must not
    be changed to suit it, so they stay whole on every rank (`ignored_params`), their
    gradients averaged by `_average_gradients`. Found before the part's module is made
    (its units are sharded first), so the units' and the module's are looked at."""
    found = {p for u in units for p in u.parameters() if p.ndim == 0}
    for p in _module_parameters(make_module):
        if p.ndim == 0:
            found.add(p)
    return found


def _module_parameters(make_module: Callable[[], nn.Module]) -> list[nn.Parameter]:
    """The parameters of the part's module, where making it has no effect (a whole
    model's make_module returns the model; a pipeline stage's builds a fresh wrapper)."""
    module = make_module()
    return list(module.parameters())


def _average_gradients(params: set[nn.Parameter], mesh: DeviceMesh) -> None:
    """The gradients of parameters FSDP2 leaves whole, averaged over its mesh (as FSDP2
    averages the ones it shards): a hook on each incoming gradient, before it is
    accumulated. A handful of scalars: one all-reduce of one number each per backward."""
    import torch.distributed as dist

    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    size = mesh.size()

    def average(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        for group in groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total / size

    for p in params:
        if p.requires_grad:
            p.register_hook(average)


class ReducedPerBlock(nn.Module):
    """An FSDP stage module as torch's pipeline schedule sees it when its gradients
    should be reduced block by block: not an FSDPModule, so the schedule runs a plain
    backward (FSDP2's own hooks reduce-scatter and free each unit after its backward)
    instead of deferring the whole stage's reduction to the step's end. Like DDP, it
    keeps the stage module as `.module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def reduced_per_block(module: nn.Module) -> nn.Module:
    """`module` as the pipeline schedule should get it when its reduction is not
    deferred (Plan.defers_stage_reduction): an FSDP stage behind ReducedPerBlock."""
    return ReducedPerBlock(module) if isinstance(module, FSDPModule) else module


def _contains(module: nn.Module, unit: nn.Module) -> bool:
    return any(m is unit for m in module.modules())


def _options(plan: Plan, precision: Precision, device: torch.device) -> dict:
    """fully_shard's keyword arguments for `plan`: precision, resharding, offload."""
    return {
        "mp_policy": precision.fsdp_policy(),
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


@dataclass
class FSDPGradientSync:
    """Gradient accumulation under FSDP2: a deferred micro-batch's backward skips the
    reduce-scatter (`set_requires_gradient_sync(False)`), switched back on after it,
    also when it raises (runners.GradientSync)."""

    module: FSDPModule

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
