"""Apply a Plan to a model, every form in one fixed order.

The order is the one that composes in PyTorch (as in torchtitan's parallelize):
tensor parallel, then activation checkpointing, then sharded/replicated data parallel
(FSDP2 when Plan.uses_fsdp, else DDP), then pipeline stages — except that with pipeline
stages the model is cut right after recomputation, and each rank shards / replicates
only what it keeps. Options that do not go together are refused by Plan.validate
before we get here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.parallel.data import apply_data_parallel, apply_data_parallel_to_stage
from meshfit.placement import is_placed
from meshfit.plan import Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshfit.parallel.pipeline import Pipeline
    from meshfit.parallel.tensor import TPPlan

# The forms other than DDP are imported when a plan uses them: FSDP2, DTensor, DCP and
# the pipelining schedules (which pull in torch._dynamo) made `import meshfit` take 6.6 s
# against 2.9 s for torch alone (2-core VM), paid by every worker; now 2.9 s.


@dataclass
class ParallelOptions:
    """What a Plan leaves to the call: the loss (pipeline stages compute it), autocast,
    user-given tp plan / pipeline cut points, and an example batch to measure."""

    loss_fn: Callable[[Any, Any], torch.Tensor]
    autocast: Callable[[], contextlib.AbstractContextManager]
    tp_plan: TPPlan | None = None
    pp_split: list[int] | None = None
    example_inputs: Any = None


def apply_plan(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None,
    device: torch.device,
    options: ParallelOptions,
) -> tuple[nn.Module, Pipeline | None]:
    """Return the model, moved to `device` and parallelized as `plan` says, and the
    pipeline that runs it when the plan has pp > 1."""
    if is_placed(model):  # the user spread it over this process's devices: keep that
        if mesh is not None:
            raise MeshfitError(
                "a model spread over devices with mf.place runs in one process; for "
                "several processes use a Plan (pp=N is the scalable form of placement)"
            )
        return model, None
    model = model.to(device)
    if plan.tp > 1:
        from meshfit.parallel.tensor import apply_tensor_parallel

        model = apply_tensor_parallel(model, mesh["tp"], options.tp_plan)
    if plan.checkpointing != "none":
        from meshfit.parallel.checkpointing import apply_checkpointing

        model = apply_checkpointing(model, plan.checkpointing)
    if mesh is None:  # one process: nothing to split
        return model, None
    if plan.uses_fsdp:
        from meshfit.parallel.fsdp import apply_fsdp, data_mesh, shard_modules, shard_stage
    if plan.pp > 1:
        from meshfit.parallel.pipeline import build_pipeline, split_model

        # Cut first, then shard / replicate what this rank keeps (as torchtitan does).
        example = options.example_inputs
        if isinstance(example, torch.Tensor):
            example = example.to(device)
        split = split_model(model, mesh["pp"], schedule=plan.schedule, split=options.pp_split,
                            example_inputs=example)  # fmt: skip
        wrap = None
        if plan.uses_fsdp:  # as below, but per module this rank keeps, rooted per stage
            shard_modules(split.trained_modules(), data_mesh(mesh), plan, device)
            wrap = lambda stage: shard_stage(stage, data_mesh(mesh), plan, device)  # noqa: E731
        elif plan.dp > 1:  # DDP per stage
            wrap = lambda stage: apply_data_parallel_to_stage(stage, mesh, device)  # noqa: E731
        pipeline = build_pipeline(
            model, split, microbatches=plan.num_microbatches, loss_fn=options.loss_fn,
            device=device, autocast=options.autocast, wrap_stage=wrap,
            register_units=plan.uses_fsdp,
        )  # fmt: skip
        return pipeline.model, pipeline
    if plan.uses_fsdp:  # sharded (and, over "dp", replicated) on FSDP2
        model = apply_fsdp(model, data_mesh(mesh), plan, device)
    elif plan.dp > 1:  # replicas only: DDP, whose bucketed all-reduce overlaps backward
        model = apply_data_parallel(model, mesh, device)
    return model, None
