"""Apply a Plan to a model: the forms as a table (`FORMS`), run in its one order, and the
runner they end with.

Each form is one entry: its name, whether it applies (to the plan and the options), and
what it does to the Build (the model, its parts, the runner being made). The order is the
one that composes in PyTorch (as torchtitan's parallelize does it): SyncBatchNorm, the
float8 conversion, then tensor parallel, activation recomputation, the pipeline cut,
sharded/replicated data parallel over the model's parts (the whole model, or each
pipeline stage this rank runs: FSDP2 when Plan.uses_fsdp, else DDP), and the runner.
Why each sits where it does is in docs/architecture.md ("The order of composition").
Options that do not go together were refused by Plan.validate.

The model's values are the weights package's (`ModelValues`): before the forms, when
its initialisation is recorded (a model on meta, after fp8), when the data-parallel form
has sharded it, and after the forms (a checkpoint given as weights).

The forms other than DDP are imported when a plan uses them: FSDP2, DTensor, DCP and the
pipelining schedules (which pull in torch._dynamo) made `import meshfit` take 6.6 s
against 2.9 s for torch alone (2-core VM), paid by every worker.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.parallel.placement import is_placed
from meshfit.runtime.precision import Precision
from meshfit.runtime.runners import GradientSync, LocalRunner, NoGradientSync, Runner
from meshfit.state.state_hooks import OwnHooks
from meshfit.topology import Topology
from meshfit.trees import call_model, map_tensors
from meshfit.weights import ModelValues

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


@dataclass(frozen=True)
class FormOptions:
    """parallelize's options the forms read (EngineOptions' own, with the loss the runner
    computes: the model's own, or the user's, with metrics beside it)."""

    loss_fn: LossFn
    tp_plan: TPPlan | None = None
    pp_split: list[int] | None = None
    example_inputs: Any = None
    example_targets: Any = None  # beside them where known (pp's coupling question)
    # (inputs, targets) of the first batch's first four samples where a micro-batch holds
    # fewer: pp's questions before the cut ask them (runtime/examples.py says why)
    question_batch: Any = None
    sync_batchnorm: bool = True
    compile: bool = False
    init: Any = None
    weights: str | None = None
    chunked_loss: bool | int = False
    fp8_recipe: str = "tensorwise"
    fp8_head: bool = False


@dataclass
class Build:
    """What the forms work on, one after the other."""

    model: nn.Module  # the user's model, changed in place by the forms
    topology: Topology
    precision: Precision
    options: FormOptions
    values: ModelValues
    own_hooks: OwnHooks
    coupling: BatchCoupling | None = None
    tp_report: TPReport | None = None
    parts: list[ModelPart] = field(default_factory=list)  # set by the pipeline cut
    split: Any = None  # the pipeline cut (PipelineSplit), under pp
    modules: list[nn.Module] = field(default_factory=list)  # the parts, wrapped
    sequence: Any = None  # context parallel's runner hook (parallel/context/)
    experts: Any = None  # expert parallel's placement and gradients (parallel/experts.py)
    head_deferred: bool = False  # chunked_loss=True: the LM head defers to the loss
    runner: Runner | None = None

    @property
    def plan(self) -> Any:
        return self.topology.plan


@dataclass(frozen=True)
class Form:
    """One parallel form: its name, whether it applies to this build, and its step."""

    name: str
    applies: Callable[[Build], bool]
    apply: Callable[[Build], None]


def apply_plan(
    model: nn.Module,
    topology: Topology,
    precision: Precision,
    options: FormOptions,
    coupling: BatchCoupling | None = None,
) -> Parallelized:
    """Parallelize `model` as `topology.plan` says; return what runs forward (the model,
    wrapped for data parallel, or this rank's pruned model under pp) and its runner.
    `options.loss_fn(outputs, targets)` is what the runner computes each micro-batch's
    loss with. `options.compile`: torch.compile over forward and loss together, so the
    loss (often a large cross-entropy over the vocabulary) fuses with the last layers;
    under pp each of this rank's blocks compiles on its own instead (parallel/compiled.py
    says why). A model on meta is split as it is and each rank materializes only what it
    keeps (weights/values.py)."""
    plan = topology.plan
    own_hooks = OwnHooks.of(model)  # before any form adds its own
    if is_placed(model) and topology.mesh is not None:
        raise MeshfitError(
            "a model spread over devices with mf.place runs in one process; for "
            "several processes use a Plan (pp=N is the scalable form of placement)"
        )
    if plan.precision == "fp8":  # refused before anything changes the model
        from meshfit.parallel.fp8 import refuse_if_nothing_converts

        refuse_if_nothing_converts(model, options.fp8_head)
    else:  # fp8's own options would change nothing
        from meshfit.parallel.fp8 import refuse_fp8_options

        refuse_fp8_options(options.fp8_recipe, options.fp8_head, plan.precision)
    if options.compile and plan.tp > 1:
        from meshfit.parallel.compiled import graphs_per_rank

        graphs_per_rank()
    values = ModelValues.of(model, own_hooks, options.init, options.weights)
    build = Build(model, topology, precision, options, values, own_hooks, coupling)
    from meshfit.weights.materialize import returned_to_the_system

    with returned_to_the_system():  # large CPU blocks freed go back to the system
        for form in FORMS:
            if form.applies(build):
                form.apply(build)
    assert build.runner is not None
    return Parallelized(build.modules[0], build.runner, build.tp_report, own_hooks)


# ---- the forms, in their order ---------------------------------------------------------


def _values_first(b: Build) -> None:
    b.values.before_forms(b.model, b.topology.mesh is not None, is_placed(b.model))
    if not is_placed(b.model) and not b.values.meta:
        b.model = b.model.to(b.topology.device)


def _batchnorm(b: Build) -> None:
    """BatchNorm normalising over the global batch (parallel/batchnorm.py)."""
    from meshfit.parallel.batchnorm import (
        refuse_microbatches,
        refuse_unsynchronisable,
        synchronise_batchnorm,
    )

    refuse_microbatches(b.model, b.plan.num_microbatches, b.plan.pp)
    refuse_unsynchronisable(b.model, b.topology.batch_parts)
    b.model = synchronise_batchnorm(b.model, b.topology.batch_groups, b.topology.device)


def _fp8(b: Build) -> None:
    """The blocks' Linears in float8 (torchao), or a warning where they already are."""
    if b.plan.precision == "fp8":
        from meshfit.parallel.fp8 import convert

        options = b.options
        convert(b.model, b.precision.fp8_emulate, options.fp8_recipe, options.fp8_head)
    else:
        from meshfit.parallel.fp8 import warn_if_converted

        warn_if_converted(b.model)


def _tensor_parallel(b: Build) -> None:
    from meshfit.parallel.tensor import apply_tensor_parallel

    device = b.topology.device
    traced = map_tensors(b.options.example_inputs, lambda t: t.to(device))  # beside the model
    b.tp_report = apply_tensor_parallel(
        b.model, b.topology.tp_mesh, b.options.tp_plan, traced, init=b.options.init,
        experts_whole=b.plan.ep > 1,
    )  # fmt: skip


def _recomputation(b: Build) -> None:
    from meshfit.parallel.recompute import apply_recomputation

    b.model = apply_recomputation(b.model, b.plan.checkpointing)


def _chunked_loss(b: Build) -> None:
    """The LM head's logits never whole: the head defers to the loss inside a step, which
    computes them a chunk of tokens at a time (parallel/head_loss.py)."""
    from meshfit.parallel.head_loss import chunked_loss_for

    b.head_deferred = chunked_loss_for(
        b.model, b.options.loss_fn, b.options.chunked_loss, b.topology.rank
    )


def _context_parallel(b: Build) -> None:
    """Each sequence cut over the cp ranks: a runner hook, nothing changed in the model
    (parallel/context/)."""
    from meshfit.parallel.context import SequenceSplit

    b.sequence = SequenceSplit(b.model, b.topology, b.options.loss_fn)


def _expert_parallel(b: Build) -> None:
    """Every experts module's experts spread whole over the ep ranks, tokens sent to them
    (parallel/experts.py); after the pipeline cut, so a rank places only its stages'."""
    from meshfit.parallel.experts import ExpertParallel

    b.experts = ExpertParallel(b.model, b.topology)


def _pipeline_cut(b: Build) -> None:
    """The model pruned in place to this rank's stages before any sharding, so each rank
    shards / replicates only what it keeps (torchtitan's pipeline_llm cuts first too);
    with compile=True each of its blocks compiled here, after the cut (its cost
    measurement times uncompiled blocks)."""
    from meshfit.parallel.pipeline import build_stage_module, split_model

    topology, model = b.topology, b.model
    valued = map_tensors(b.options.example_inputs, lambda t: t.to(topology.device))
    refused = None
    if topology.batch_parts > 1 and not b.values.meta and valued is not None:
        refused = _ask_before_the_cut(b, valued)

    def before_pruning() -> None:  # the cut's own checks passed: a coupling refuses now
        if refused:
            raise MeshfitError(refused)

    # a model on meta counts its blocks' FLOPs on meta: shapes only, no memory
    where = "meta" if b.values.meta else topology.device
    example = map_tensors(b.options.example_inputs, lambda t: t.to(where))
    split = split_model(
        model,
        topology.pp_mesh,
        schedule=b.plan.schedule,
        split=b.options.pp_split,
        example_inputs=example,
        ends_group=topology.pipeline_ends_group,
        valued_inputs=valued,
        before_pruning=before_pruning,
    )
    if b.plan.uses_fsdp:
        _refuse_enclosing_owners(model, split)
    if b.options.compile:
        from meshfit.parallel.compiled import compile_block_forwards

        blocks = split.stack.container._modules
        compile_block_forwards([blocks[k] for s in split.mine for k in split.stage_keys[s]])
    autocast = b.precision.autocast
    b.split = split
    b.parts = [
        ModelPart(
            units=split.owners(s),
            make_module=lambda s=s: build_stage_module(model, split, s, autocast),
            pipeline_stage=True,
        )
        for s in split.mine
    ]


def _ask_before_the_cut(b: Build, example: Any) -> str | None:
    """Where the plan splits the batch, asked on the whole model before the cut (the
    probe cannot run under a pipeline schedule), on `example` (the example inputs on
    the device; a model on meta has no values to run: not asked): a loss or module that
    couples the samples (coupling/batch.py: its refusal returned, raised after the
    cut's own checks), then buffers the forward updates from its batch
    (coupling/statistics.py)."""
    from meshfit.coupling.batch import pipeline_coupling_refusal
    from meshfit.coupling.statistics import before_pipeline_cut, parts_named

    topology = b.topology
    targets = b.options.example_targets
    if b.options.question_batch is not None:  # small micro-batches: four samples
        example, targets = b.options.question_batch
        example = map_tensors(example, lambda t: t.to(topology.device))
    asked = {
        "plan": b.plan,
        "parts": parts_named(topology.dp_size, b.plan.num_microbatches),
        "low_precision": b.plan.precision != "fp32",
        "world": dist.group.WORLD if dist.is_initialized() else None,
    }
    targets = map_tensors(targets, lambda t: t.to(topology.device))
    loss_fn = _users_loss(b.options.loss_fn)
    refused, verdict = pipeline_coupling_refusal(b.model, example, targets, loss_fn, **asked)
    if verdict is not None and (sample_sum := _sample_sum(b.options.loss_fn)) is not None:
        sample_sum.take_before_the_cut(verdict)
    own = not b.options.sync_batchnorm
    line = before_pipeline_cut(b.model, example, own_statistics=own, **asked)
    if line and topology.rank == 0:
        print(f"meshfit: {line}", flush=True)
    return refused


def _questions_of_the_first_pass(b: Build) -> Any:
    """Where the plan splits the batch: the coupling question the pipeline's first pass
    asks of what its stages ran (coupling/stages.py), of the user's loss on the last
    stage, and of every stage for a model built on meta (no values before the cut).
    Not under cp (its probe through the stages asks about the sequence's cut)."""
    from meshfit.coupling.stages import StageQuestions
    from meshfit.coupling.statistics import parts_named
    from meshfit.parallel.pipeline.schedule import _unwrapped

    if b.topology.batch_parts == 1 or b.sequence is not None:
        return None
    loss_fn = _users_loss(b.options.loss_fn)
    # chunked_loss: the loss computes the LM head from deferred outputs it holds by
    # reference, which a call outside the schedule's order spoils (measured: NaN losses)
    asked = loss_fn is not None and not b.head_deferred
    # the stages of a model built on meta; beside tp too (each tp peer asks the same
    # questions of the same micro-batch, so their collectives keep in step: a buffer tp
    # split is compared whole, statistics._same); not beside ep, whose stage forwards
    # exchange tokens with ranks that hold other samples
    asks_stages = b.values.meta and b.experts is None
    stages = [_unwrapped(m) for m in b.modules] if asks_stages else []
    return StageQuestions(
        loss_fn if asked else None,
        stages,
        b.model,
        plan=b.plan,
        parts=parts_named(b.topology.dp_size, b.plan.num_microbatches),
        low_precision=True if b.plan.precision != "fp32" else None,  # None: the dtype's
        own_statistics=not b.options.sync_batchnorm,
    )


def _sample_sum(loss_fn: Any) -> Any:
    """The engine's SampleSum under the wrappers the runner calls (MetricTap), or None."""
    from meshfit.losses import SampleSum
    from meshfit.metrics import MetricTap

    while isinstance(loss_fn, MetricTap):
        loss_fn = loss_fn.loss_fn
    return loss_fn if isinstance(loss_fn, SampleSum) else None


def _users_loss(loss_fn: Any) -> Any:
    """The user's loss function out of the wrappers the runner calls (SampleSum decides
    on its first call under pp, its own question on the last stage; MetricTap records
    metrics), or None for the model's own loss, whose questions run the forward alone."""
    from meshfit.losses import ModelOwnLoss, SampleSum
    from meshfit.metrics import MetricTap

    while isinstance(loss_fn, (SampleSum, MetricTap)):
        loss_fn = loss_fn.loss_fn
    return None if isinstance(loss_fn, ModelOwnLoss) or not callable(loss_fn) else loss_fn


def _data_parallel(b: Build) -> None:
    """FSDP2 or DDP over each part (the whole model, or each stage this rank runs); the
    values of a meta model given once FSDP2 has sharded it, or before DDP."""
    from meshfit.parallel.ddp import skips_layers_at_random
    from meshfit.parallel.experts import reach_every_expert, routed_experts

    routed = routed_experts(b.model)  # one walk serves the FSDP units and the hooks
    if not b.parts:  # no pipeline: the whole model is the one part
        model = b.model
        b.parts = [ModelPart(units=_blocks_or_none(model, routed), make_module=lambda: model)]

    placed = set(b.experts.parameters) if b.experts is not None else set()
    skips = skips_layers_at_random(b.model)
    if b.topology.mesh is not None and (b.plan.uses_fsdp or b.topology.grad_average_size > 1):
        reach_every_expert(b.model, routed)  # every rank reduces the same gradients
    b.modules = apply_data_parallel(b.parts, b.topology, b.precision, b.values, placed, skips)
    if b.split is not None and b.plan.uses_fsdp and not b.plan.defers_stage_reduction:
        from meshfit.parallel.fsdp import reduced_per_block

        b.modules = [reduced_per_block(m) for m in b.modules]


def _runner(b: Build) -> None:
    """The pipeline schedule over the stages, or the local runner over the whole model
    (with compile=True, forward and loss compiled together)."""
    plan, loss_fn = b.plan, b.options.loss_fn
    if b.split is not None:
        from meshfit.parallel.pipeline import build_pipeline

        b.runner = build_pipeline(
            b.model,
            b.split,
            b.modules,
            microbatches=plan.num_microbatches,
            loss_fn=loss_fn,
            device=b.topology.device,
            coupling=b.coupling,
            sequence=b.sequence,
            experts=b.experts,
            head_deferred=b.head_deferred,
            questions=_questions_of_the_first_pass(b),
        )
        b.modules = [b.model]  # what runs forward: this rank's pruned model
        return
    [wrapped] = b.modules

    def forward_loss(module: nn.Module, inputs: Any, targets: Any) -> Any:
        return loss_fn(call_model(module, inputs), targets)

    b.runner = LocalRunner(
        wrapped,
        torch.compile(forward_loss) if b.options.compile else forward_loss,
        b.precision,
        plan.num_microbatches,
        _gradient_sync(wrapped, b.topology),
        coupling=b.coupling,
        eager_forward_loss=forward_loss,
        sequence=b.sequence,
        experts=b.experts,
        head_deferred=b.head_deferred,
    )


def _values_last(b: Build) -> None:
    b.values.after_forms(b.modules[0], strided=b.plan.tp > 1)


def _say_weights(b: Build) -> None:
    line = b.values.describe()
    if line and b.topology.rank == 0:
        print(f"meshfit: {line}", flush=True)


FORMS: tuple[Form, ...] = (
    Form("initial values", lambda b: True, _values_first),
    Form("SyncBatchNorm", lambda b: b.options.sync_batchnorm, _batchnorm),
    # only torchao makes Float8Linear layers: without it there is nothing to warn of
    Form("float8", lambda b: b.plan.precision == "fp8" or "torchao" in sys.modules, _fp8),
    Form("initialisation (meta)", lambda b: b.values.meta, lambda b: b.values.record_initialization(b.model)),
    Form("tensor parallel", lambda b: b.plan.tp > 1, _tensor_parallel),
    Form("recomputation", lambda b: b.plan.checkpointing != "none", _recomputation),
    Form("chunked loss", lambda b: b.options.chunked_loss is not False, _chunked_loss),
    Form("context parallel", lambda b: b.plan.cp > 1, _context_parallel),
    Form("pipeline cut", lambda b: b.plan.pp > 1, _pipeline_cut),
    Form("expert parallel", lambda b: b.plan.ep > 1, _expert_parallel),
    Form("data parallel", lambda b: True, _data_parallel),
    Form("runner", lambda b: True, _runner),
    Form("checkpoint as weights", lambda b: b.values.checkpoint is not None, _values_last),
    Form("weights said", lambda b: b.options.weights is not None, _say_weights),
)  # fmt: skip


def _refuse_enclosing_owners(model: nn.Module, split: Any) -> None:
    """fsdp x pp cannot shard a parameter registered on a module around the blocks (the
    model itself, say): FSDP2 over that module would take every block's parameters too,
    and sharding it alone leaves the model reading the unsharded original. Refuse it
    before anything is changed (measured: torch raised "Cannot concatenate overlapping
    meshes" from fully_shard)."""
    from meshfit.parallel.pipeline.checks import _encloses

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
    values: ModelValues | None = None,
    placed: set[nn.Parameter] = frozenset(),
    find_unused: bool = False,
) -> list[nn.Module]:
    """Shard (FSDP2) or replicate (DDP) each part over the data-parallel ranks; the one
    path for whole models and pipeline stages alike. Returns the parts' modules. A meta
    model's `values` are given once the parts are sharded under FSDP2, so each rank's
    storage is its shard from the start; before DDP, which broadcasts real values (its
    replicas are whole anyway)."""
    plan, device = topology.plan, topology.device
    sharded = topology.mesh is not None and plan.uses_fsdp
    if values is not None and not sharded:
        values.materialize(device)
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
                ignored=placed,
            )
        else:
            module = part.make_module()
            if topology.mesh is not None and topology.grad_average_size > 1:
                from meshfit.parallel.ddp import replicate

                module = replicate(
                    module,
                    topology.replica_group,
                    device,
                    pipeline_stage=part.pipeline_stage,
                    ignored=placed,
                    find_unused=find_unused,
                )
        modules.append(module)
    if values is not None and sharded:
        values.materialize(device)
    return modules


def _gradient_sync(module: nn.Module, topology: Topology) -> GradientSync:
    """The way `module`, as apply_data_parallel wrapped it, defers gradient reduction."""
    if topology.mesh is not None and topology.plan.uses_fsdp:
        from meshfit.parallel.fsdp import FSDPGradientSync

        return FSDPGradientSync(module)
    if topology.mesh is not None and topology.grad_average_size > 1:
        from meshfit.parallel.ddp import DDPGradientSync

        return DDPGradientSync(module)
    return NoGradientSync()


def _blocks_or_none(model: nn.Module, routed: list[tuple[nn.Module, nn.Module]]) -> list[nn.Module]:
    """The FSDP2 units of a whole model: its blocks, or none (one unit) where it has no
    repeated blocks or they are routed experts (`routed`: experts.routed_experts)."""
    from meshfit.parallel.blocks import find_blocks

    try:
        stack = find_blocks(model)
    except MeshfitError:
        return []  # no repeated unit: one FSDP unit for the whole model
    # Experts that a rank's tokens may skip are no FSDP units: a unit all-gathers in its
    # forward, and a rank that skipped one left the others waiting in its all-gather (a
    # ModuleList of experts, the model's only repeated modules, hung under fsdp=2)
    if any(stack.container is experts for _, experts in routed):
        return []
    return list(stack.blocks)
