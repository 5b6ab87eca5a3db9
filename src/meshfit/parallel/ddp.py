"""Replicated data parallel: PyTorch's DistributedDataParallel over the replicas' group."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshfit.coupling.buffers import is_broadcast


def replicate(
    module: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    pipeline_stage: bool = False,
    ignored: set[nn.Parameter] = frozenset(),
    find_unused: bool = False,
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
    if find_unused:  # LayerDrop (skips_layers_at_random)
        options["find_unused_parameters"] = True
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


def skips_layers_at_random(model: nn.Module) -> bool:
    """Whether the model's config draws LayerDrop in training (transformers' wav2vec2,
    HuBERT, Whisper, BART, ...: `layerdrop`, `encoder_layerdrop`, `decoder_layerdrop`;
    wav2vec2's default is 0.1): each rank skips other layers at each step, so DDP must
    look for the unused parameters from the first step on (a rank that skipped none
    would wait in a reduction the others never start)."""
    config = getattr(model, "config", None)
    names = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
    return any(float(getattr(config, name, 0.0) or 0.0) > 0 for name in names)


def replicas_in(modules: list[nn.Module]) -> list[DistributedDataParallel]:
    """The DDP wrappers in `modules` and their submodules, each once."""
    found: list[DistributedDataParallel] = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, DistributedDataParallel) and not any(m is f for f in found):
                found.append(m)
    return found


def find_unused_where_missing(
    replicas: list[DistributedDataParallel], device: torch.device
) -> None:
    """After a first backward: each DDP wrapper one of whose replicas has a trainable
    parameter with no gradient is rebuilt to find unused parameters (agreed over its
    replicas' group, in the same order on each); the others (another pipeline stage's)
    stay as they are, without the extra pass."""
    for ddp in replicas:
        here = any(p.requires_grad and p.grad is None for p in ddp.module.parameters())
        flag = torch.tensor([1.0 if here else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ddp.process_group)
        if flag.item() > 0:
            find_unused_from_now_on(ddp)


def find_unused_from_now_on(ddp: DistributedDataParallel) -> None:
    """Rebuild `ddp` in place with find_unused_parameters=True (its reducer is fixed at
    construction): a parameter with no gradient then counts as ready, where without it
    its bucket never reduced and torch stopped the next step ("Expected to have finished
    reduction in the prior iteration"). The old reducer's hooks are removed first; the
    wrapper object stays the one the runner, the schedule and the gradient sync hold.
    A collective over the replicas' group (DDP's construction checks and broadcasts):
    every replica calls it."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    options = {sync: ddp.broadcast_buffers, "find_unused_parameters": True}
    grad_sync = ddp.require_backward_grad_sync
    ddp._remove_autograd_hooks()
    fresh = DistributedDataParallel(
        ddp.module, device_ids=ddp.device_ids, process_group=ddp.process_group, **options
    )
    fresh.require_backward_grad_sync = grad_sync
    ddp.__dict__.clear()
    ddp.__dict__.update(fresh.__dict__)


@dataclass
class StepUndo:
    """What a first training step changes besides the gradients, taken before it so it
    can run again as if for the first time: the random state (dropout's masks) and every
    buffer (BatchNorm's running statistics)."""

    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    buffers: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def taken(cls, modules: list[nn.Module]) -> StepUndo:
        seen: set[int] = set()
        buffers = []
        for root in modules:
            for b in root.buffers():
                # a pipeline stage's placeholder cannot be written: nothing changes it
                if id(b) not in seen and not is_broadcast(b):
                    seen.add(id(b))
                    buffers.append((b, b.detach().clone()))
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda, buffers)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)


def on_any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank of the job (one small all-reduce)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
