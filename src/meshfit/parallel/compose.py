"""Apply a Plan to a model, every form in one fixed order, and pick the runner.

The order is the one that composes in PyTorch (as in torchtitan's parallelize):
the float8 conversion (precision="fp8"), then tensor parallel, then activation recomputation, then the pipeline cut (pp > 1), then
sharded/replicated data parallel over the model's parts: the whole model, or each
pipeline stage this rank runs. Both take the same path (`apply_data_parallel`): FSDP2
when Plan.uses_fsdp, else DDP. Options that do not go together are refused by
Plan.validate before we get here.

The forms other than DDP are imported when a plan uses them: FSDP2, DTensor, DCP and the
pipelining schedules (which pull in torch._dynamo) made `import meshfit` take 6.6 s
against 2.9 s for torch alone (2-core VM), paid by every worker.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.placement import is_placed
from meshfit.precision import Precision
from meshfit.runners import GradientSync, LocalRunner, NoGradientSync, Runner
from meshfit.state_hooks import OwnHooks
from meshfit.topology import Topology
from meshfit.trees import call_model, map_tensors

if TYPE_CHECKING:
    from meshfit.coupling.batch import BatchCoupling
    from meshfit.parallel.tensor import TPPlan, TPReport

LossFn = Callable[[Any, Any], Any]


@dataclass
class ModelPart:
    """A part of the model that trains as one piece: the whole model, or one pipeline
    stage. `units` are its sub-modules that FSDP2 shards one by one (the repeated blocks,
    and for a stage the modules before / after them that it trains); `make_module`
    returns the part's module once its units are sharded (a stage module lists the
    parameters it trains, and sharding replaces parameter objects)."""

    units: list[nn.Module]
    make_module: Callable[[], nn.Module]
    pipeline_stage: bool = False


class Parallelized(NamedTuple):
    """What apply_plan made: what runs forward, its runner, what tp split, and the
    model's own state-dict hooks (state_hooks.py)."""

    model: nn.Module
    runner: Runner
    tp_report: TPReport | None
    own_hooks: OwnHooks


def apply_plan(
    model: nn.Module,
    topology: Topology,
    precision: Precision,
    *,
    loss_fn: LossFn,
    tp_plan: TPPlan | None = None,
    pp_split: list[int] | None = None,
    example_inputs: Any = None,
    sync_batchnorm: bool = True,
    compile: bool = False,
    init: Any = None,
    weights: str | None = None,
    coupling: BatchCoupling | None = None,
) -> Parallelized:
    """Parallelize `model` as `topology.plan` says; return what runs forward (the model,
    wrapped for data parallel, or this rank's pruned model under pp) and its runner.
    `loss_fn(outputs, targets)` is what the runner computes each micro-batch's loss with.
    `compile`: torch.compile over forward and loss together, so the loss (often a large
    cross-entropy over the vocabulary) fuses with the last layers; under pp each of this
    rank's blocks compiles on its own instead (parallel/compiled.py says why). A model on meta is split as it is and
    each rank materializes only what it keeps (materialize.py; `init` as there), from
    the safetensors at `weights` where given (each rank reads only its slices)."""
    from meshfit.materialize import on_meta
    from meshfit.weight_files import WeightFiles, load_weights

    plan, mesh, device = topology.plan, topology.mesh, topology.device
    own_hooks = OwnHooks.of(model)  # before any form adds its own
    if compile and plan.tp > 1:
        from meshfit.parallel.compiled import graphs_per_rank

        graphs_per_rank()
    meta = on_meta(model)
    if is_placed(model):  # the user spread it over this process's devices: keep that
        if mesh is not None:
            raise MeshfitError(
                "a model spread over devices with mf.place runs in one process; for "
                "several processes use a Plan (pp=N is the scalable form of placement)"
            )
    if plan.precision == "fp8":  # refused before anything changes the model
        from meshfit.fp8 import refuse_if_nothing_converts

        refuse_if_nothing_converts(model)
    from meshfit.checkpoint import holds_checkpoint, model_fingerprint

    # a meshfit checkpoint is read by DCP once the model is split (load_model_weights);
    # safetensors slice by slice as each rank materializes, or whole here
    checkpoint = weights if weights is not None and holds_checkpoint(weights) else None
    fingerprint = model_fingerprint(model) if checkpoint is not None else None
    files = WeightFiles(weights) if weights is not None and checkpoint is None else None
    if files is not None and meta and own_hooks.loading:
        raise MeshfitError(
            f"weights= cannot be read slice by slice into this model built on meta: "
            f"{own_hooks.loading[0] or type(model).__name__} changes the names it loads "
            f"in its own load_state_dict hooks; build the model on the CPU (weights= "
            f"then loads through those hooks), or load a meshfit checkpoint"
        )
    if files is not None and not meta:  # a model with values: whole here anyway
        load_weights(model, files, own_hooks)
    if mesh is not None and not meta and not is_placed(model):
        from meshfit.parallel.same_start import start_from_rank0

        start_from_rank0(model)  # where the workers built other initial weights (no seed)
    if not is_placed(model) and not meta:
        model = model.to(device)
    if sync_batchnorm:
        from meshfit.parallel.batchnorm import (
            refuse_microbatches,
            refuse_unsynchronisable,
            synchronise_batchnorm,
        )

        refuse_microbatches(model, plan.num_microbatches, plan.pp)
        refuse_unsynchronisable(model, topology.batch_parts)
        model = synchronise_batchnorm(model, topology.batch_groups, device)
    if plan.precision == "fp8":  # before every parallel form, as torchtitan converts
        from meshfit.fp8 import convert

        convert(model, emulate=precision.fp8_emulate)
    elif "torchao" in sys.modules:  # only torchao makes Float8Linear layers
        from meshfit.fp8 import warn_if_converted

        warn_if_converted(model)
    materialize = None
    if meta:  # captured before any form changes the model (after fp8's swap of Linears)
        from meshfit.materialize import materialize as fill
        from meshfit.materialize import plan_initialization

        initializer = plan_initialization(model, init)
        materialize = lambda: fill(initializer, model, device, files)  # noqa: E731
    tp_report = None
    if plan.tp > 1:
        from meshfit.parallel.tensor import apply_tensor_parallel

        traced = map_tensors(example_inputs, lambda t: t.to(device))  # beside the model
        tp_report = apply_tensor_parallel(model, topology.tp_mesh, tp_plan, traced, init=init)
    if plan.checkpointing != "none":
        from meshfit.parallel.recompute import apply_recomputation

        model = apply_recomputation(model, plan.checkpointing)
    if plan.pp > 1:
        model, runner = _apply_pipeline(
            model,
            topology,
            precision,
            loss_fn=loss_fn,
            pp_split=pp_split,
            example_inputs=example_inputs,
            compile_blocks=compile,
            materialize=materialize,
            coupling=coupling,
        )
        made = Parallelized(model, runner, tp_report, own_hooks)
    else:
        part = ModelPart(units=_blocks_or_none(model), make_module=lambda: model)
        [wrapped] = apply_data_parallel([part], topology, precision, materialize)

        def forward_loss(module: nn.Module, inputs: Any, targets: Any) -> Any:
            return loss_fn(call_model(module, inputs), targets)

        runner = LocalRunner(
            wrapped,
            torch.compile(forward_loss) if compile else forward_loss,
            precision,
            plan.num_microbatches,
            _gradient_sync(wrapped, topology),
            coupling=coupling,
            eager_forward_loss=forward_loss,
        )
        made = Parallelized(wrapped, runner, tp_report, own_hooks)
    if checkpoint is not None:
        from meshfit.checkpoint import load_model_weights

        with own_hooks.set_aside():  # a checkpoint holds the modules' own names
            load_model_weights(made.model, checkpoint, fingerprint, strided=plan.tp > 1)
    return made


def _apply_pipeline(
    model: nn.Module,
    topology: Topology,
    precision: Precision,
    *,
    loss_fn: LossFn,
    pp_split: list[int] | None,
    example_inputs: Any,
    compile_blocks: bool,
    materialize: Callable[[], None] | None,
    coupling: BatchCoupling | None = None,
) -> tuple[nn.Module, Runner]:
    """Cut first, then replicate / shard what this rank keeps, stage by stage (as
    torchtitan's pipeline_llm does), then build the schedule over the stages."""
    from meshfit.parallel.pipeline import build_pipeline, build_stage_module, split_model

    plan, device = topology.plan, topology.device
    # a model on meta counts its blocks' FLOPs on meta: shapes only, no memory
    where = "meta" if materialize is not None else device
    example = map_tensors(example_inputs, lambda t: t.to(where))
    split = split_model(
        model,
        topology.pp_mesh,
        schedule=plan.schedule,
        split=pp_split,
        example_inputs=example,
        ends_group=topology.pipeline_ends_group,
    )
    if plan.uses_fsdp:
        _refuse_enclosing_owners(model, split)
    if compile_blocks:  # after the cut: its cost measurement times uncompiled blocks
        from meshfit.parallel.compiled import compile_block_forwards

        blocks = split.stack.container._modules
        compile_block_forwards([blocks[k] for s in split.mine for k in split.stage_keys[s]])
    parts = [
        ModelPart(
            units=split.owners(s),
            make_module=lambda s=s: build_stage_module(model, split, s, precision.autocast),
            pipeline_stage=True,
        )
        for s in split.mine
    ]
    stage_modules = apply_data_parallel(parts, topology, precision, materialize)
    if plan.uses_fsdp and not plan.defers_stage_reduction:
        from meshfit.parallel.fsdp import reduced_per_block

        stage_modules = [reduced_per_block(m) for m in stage_modules]
    runner = build_pipeline(
        model,
        split,
        stage_modules,
        microbatches=plan.num_microbatches,
        loss_fn=loss_fn,
        device=device,
        coupling=coupling,
    )
    return model, runner


def _refuse_enclosing_owners(model: nn.Module, split: Any) -> None:
    """fsdp x pp cannot shard a parameter registered on a module around the blocks (the
    model itself, say): FSDP2 over that module would take every block's parameters too,
    and sharding it alone leaves the model reading the unsharded original. Refuse it
    before anything is changed (measured: torch raised "Cannot concatenate overlapping
    meshes" from fully_shard)."""
    from meshfit.parallel.pipeline.cut import _encloses

    names = {id(m): n for n, m in model.named_modules()}
    found = []
    for module, _, _ in [*split.head, *split.tail]:  # known on every rank
        if _encloses(module, split.stack.container):
            prefix = names.get(id(module), "")
            own = [n for n, _ in module.named_parameters(recurse=False)]
            found += [f"{prefix}.{n}" if prefix else n for n in own]
    if found:
        raise MeshfitError(
            f"fsdp x pp cannot shard {', '.join(sorted(set(found)))}: a parameter registered "
            f"on a module that holds the pipeline's blocks; use dp instead of fsdp with pp "
            f"(e.g. 'dp=2,pp=2'), or fsdp without pp"
        )


def apply_data_parallel(
    parts: list[ModelPart],
    topology: Topology,
    precision: Precision,
    materialize: Callable[[], None] | None = None,
) -> list[nn.Module]:
    """Shard (FSDP2) or replicate (DDP) each part over the data-parallel ranks; the one
    path for whole models and pipeline stages alike. Returns the parts' modules.
    `materialize` (a model on meta): called once the parts are sharded under FSDP2, so
    each rank's storage is its shard from the start; before DDP, which broadcasts real
    values (its replicas are whole anyway)."""
    plan, device = topology.plan, topology.device
    sharded = topology.mesh is not None and plan.uses_fsdp
    if materialize is not None and not sharded:
        materialize()
    modules = []
    for part in parts:
        if sharded:
            from meshfit.parallel.fsdp import shard_part

            module = shard_part(
                part.units,
                part.make_module,
                topology.data_mesh,
                plan,
                precision,
                device,
                pipeline_stage=part.pipeline_stage,
            )
        else:
            module = part.make_module()
            if topology.mesh is not None and plan.dp > 1:
                from meshfit.parallel.ddp import replicate

                module = replicate(
                    module, topology.replica_group, device, pipeline_stage=part.pipeline_stage
                )
        modules.append(module)
    if materialize is not None and sharded:
        materialize()
    return modules


def _gradient_sync(module: nn.Module, topology: Topology) -> GradientSync:
    """The way `module`, as apply_data_parallel wrapped it, defers gradient reduction."""
    if topology.mesh is not None and topology.plan.uses_fsdp:
        from meshfit.parallel.fsdp import FSDPGradientSync

        return FSDPGradientSync(module)
    if topology.mesh is not None and topology.plan.dp > 1:
        from meshfit.parallel.ddp import DDPGradientSync

        return DDPGradientSync(module)
    return NoGradientSync()


def _blocks_or_none(model: nn.Module) -> list[nn.Module]:
    from meshfit.parallel.blocks import find_blocks

    try:
        return list(find_blocks(model).blocks)
    except MeshfitError:
        return []  # no repeated unit: one FSDP unit for the whole model
