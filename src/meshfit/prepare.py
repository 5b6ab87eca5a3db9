"""The way in: `mf.parallelize` checks its options (options.py), resolves the plan on
this job (`prepare`: the planner for "auto", the process group, the Topology) and builds
the Engine. `fit` and `mf.predict` come in through the same `prepare`, with the user's
data as the example batch (`Examples`); `verify` runs `parallelize` on each side.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.launch import watchdog
from meshfit.options import EngineOptions, LossFn, OptimizerFactory, SchedulerFactory
from meshfit.plan import Plan, is_auto
from meshfit.runtime.examples import BuildExample, Examples, to_build_on
from meshfit.topology import Topology
from meshfit.trees import tensors_in

if TYPE_CHECKING:
    from meshfit.parallel.tensor import TPPlan


def parallelize(
    model: nn.Module,
    plan: Plan | str | None = None,
    *,
    optimizer: OptimizerFactory | None = None,
    loss_fn: LossFn | None = None,
    grad_clip: float | None = None,
    lr_scheduler: SchedulerFactory | None = None,
    compile: bool = False,
    tp_plan: TPPlan | None = None,
    pp_split: list[int] | None = None,
    example_inputs: Any = None,
    sync_batchnorm: bool = True,
    blocks: str | None = None,
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
    init: Callable[[nn.Module], None] | Sequence[Callable[[nn.Module], None]] | None = None,
    weights: str | os.PathLike | None = None,
    chunked_loss: bool | int = False,
    fp8_recipe: str = "tensorwise",
    fp8_head: bool = False,
) -> Engine:
    """Split `model` over this job's processes as `plan` says and return an Engine.

    plan: a Plan, its text form ("dp=4"), or None for data parallel over every process.
        "auto": the planner chooses (mf.plan_search on this job's processes, for a global
        batch of example_inputs' size); "auto,precision=bf16" keeps the fields given.
    optimizer: a function from parameters to an optimizer, e.g.
        ``lambda params: torch.optim.AdamW(params, lr=3e-4)`` (default: AdamW, lr 3e-4).
        A function, not an optimizer, because parallel forms may replace the parameters.
    loss_fn: ``loss_fn(outputs, targets)``, where outputs is whatever the model returns
        (called as ``model(**inputs)`` for a mapping, else ``model(inputs)``); it returns
        the mean loss over the batch, or a pair ``(loss_sum, count)`` that meshfit
        normalises by the global count (exact for masked tokens under any plan; e.g.
        ``mf.losses.cross_entropy(ignore_index=-100)``). ``"model"``: the model's own
        loss (``outputs.loss``); a batch is then the mapping the model takes, labels
        included (see `mf.losses.ModelOwnLoss`).
    grad_clip: clip the global gradient norm to this value.
    lr_scheduler: a function from the optimizer to a torch LR scheduler, stepped once per
        training step.
    compile: run forward and loss through ``torch.compile`` (off by default: the first
        steps then take longer while it compiles; on a GPU the rest are faster). Under
        pp each of the rank's blocks compiles on its own and the rest of the stage runs
        eagerly (parallel/compiled.py).
    tp_plan: for tp > 1, ``{module name or pattern: "colwise" | "colwise:N" | "rowwise"}``
        instead of the plan meshfit derives by tracing the blocks' computation.
    pp_split: for pp > 1, the block indices where stages 2, 3, ... begin, instead of
        the balanced cut meshfit chooses.
    example_inputs: one micro-batch of inputs; with pp > 1 meshfit counts each block's
        forward FLOPs on it and balances the stages by them, and checks the cut on it on
        every rank before training; with tp > 1 it traces the blocks on it. Without it,
        the first batch given to step, evaluate or predict serves (the split, optimizer
        and scheduler are built then); what reads them earlier (engine.optimizer,
        engine.load) builds them on an input meshfit makes up, and pp balances by
        parameter count.
    sync_batchnorm: BatchNorm layers normalise with the statistics of the whole global
        batch, over the data-parallel ranks, as in one process (default). A BatchNorm
        model is then refused with more than one micro-batch, which BatchNorm would
        normalise one by one. False: each rank and micro-batch uses its own statistics
        (no communication; not the one-process run), BatchNorm's and those of any
        buffer the forward updates from its batch and reads (a VQ-VAE's codebook
        averages), which are otherwise refused under a plan that splits the batch.
    blocks: the qualified name of the container (nn.ModuleList / Sequential /
        ModuleDict) that holds the model's repeated blocks, e.g. "model.layers", where
        meshfit's guess (the largest container of same-type modules) is not the one
        to split. tp, pp, recomputation and fsdp all use it.
    metrics: {name: fn(outputs, targets)} computed beside the loss on every batch, over
        the global batch (a mean per micro-batch, or a (sum, count) pair; e.g.
        ``{"acc": mf.metrics.accuracy}``); engine.last_metrics holds the values of the
        last step or evaluation, and fit records them.
    init: for a model built on meta (``with torch.device("meta")``), which every form
        splits as it is and each rank materializes only its part of: a function of a
        module (or a list of them, one pass each) that sets its initial values, called
        on every module after its children and after the module's own
        reset_parameters, as ``Module.apply`` would (default: a Hugging Face model's own
        _init_weights). The values equal one process's under every plan
        (materialize.py says how, and what it refuses).
    weights: pretrained weights to start from: a .safetensors file, or a directory with
        model.safetensors or Hugging Face's shards and model.safetensors.index.json
        (save_pretrained's, `engine.save_model`'s). Names are the model's state_dict
        names (a tied weight under either); a tensor the file lacks, one it holds that
        the model lacks, or one of another shape is refused by name before training.
        With a model built on meta each rank reads only the slices it keeps. Or a meshfit
        checkpoint (a step directory, or a checkpoint_dir for its newest step): its model
        values only, read by DCP into the split model (each rank its pieces).
    chunked_loss: compute the LM head's product and the cross-entropy a chunk of tokens
        at a time, gradients included, so no step holds the whole logits (a 128k
        vocabulary at 8,192 tokens: 4.2 GB of float32 logits and as much for their
        gradient). True: 64M logits a chunk; a number: that many tokens a chunk. For
        ``loss_fn=mf.losses.cross_entropy(...)`` and for ``loss_fn="model"`` on a Hugging
        Face causal or masked LM; the same loss and gradients as the whole computation
        (parallel/head_loss.py). Under tp a head split over the vocabulary runs its
        chunks over each rank's share of the words, the logits never gathered.
    fp8_recipe, fp8_head: under precision="fp8", how torchao takes the float8 scales
        ("tensorwise", the default; "rowwise"; "rowwise_with_gw_hp") and whether the
        output layer (LM head) runs in float8 too (default: it stays bf16, as in
        torchtitan); refused under other precisions (parallel/fp8.py).
    """
    if not isinstance(model, nn.Module):
        raise MeshfitError(f"parallelize needs a torch.nn.Module, not {type(model).__name__}")
    options = EngineOptions(
        loss_fn=loss_fn,
        optimizer=optimizer,
        grad_clip=grad_clip,
        lr_scheduler=lr_scheduler,
        compile=compile,
        tp_plan=tp_plan,
        pp_split=pp_split,
        example_inputs=example_inputs,
        sync_batchnorm=sync_batchnorm,
        blocks=blocks,
        metrics=metrics,
        init=init,
        weights=weights,
        chunked_loss=chunked_loss,
        fp8_recipe=fp8_recipe,
        fp8_head=fp8_head,
    )
    job = prepare(model, plan, options)
    engine = job.engine(model)
    if job.auto is not None and engine.rank == 0:
        print(f"meshfit: {job.auto.describe()}", flush=True)
    watchdog.mark("script", "the training script before step 1", waiting=False)
    return engine


@dataclass(frozen=True)
class Job:
    """A plan resolved on this job: its Topology, the planner's choice for an "auto"
    plan (or None), the options with the example batch the forms use, and what the
    engine builds on from the user's data (fit, predict: runtime/examples.to_build_on;
    None where it waits for its first batch)."""

    topology: Topology
    auto: Any
    options: EngineOptions
    build_on: BuildExample | None = None

    def engine(self, model: nn.Module) -> Engine:
        engine = Engine(model, self.topology, self.options, self.build_on)
        engine.planned = self.auto
        return engine


def prepare(
    model: nn.Module,
    plan: Plan | str | None,
    options: EngineOptions,
    examples: Examples | None = None,
) -> Job:
    """Resolve `plan` on this job, the one way `parallelize`, `fit` and `predict` come
    in: the blocks named, the auto plan chosen (on `examples`, else on the options'
    example_inputs), the process group started, the options that depend on the plan
    checked against it, and the forms given an example batch of the user's data
    (`examples`) where they use one and none was given."""
    if options.blocks is not None:
        from meshfit.parallel.blocks import use_blocks

        use_blocks(model, options.blocks)
    from meshfit.weights.keras import read_weights_from_modules

    read_weights_from_modules(model)  # Keras layers: before the planner and the forms
    auto = None
    if auto_requested(plan):
        auto = _choose_auto(model, auto_requested(plan), options, examples)
        plan = auto.plan
    plan, note = one_microbatch_for_batchnorm(model, as_plan(plan), options)
    topology = Topology.create(plan)
    if note:
        topology.notes.append(note)
    options_fit(options, topology.plan)
    build_on = None
    if options.example_inputs is None and examples is not None:
        # the targets too: pp's questions before the cut run the user's loss on them
        build_on = to_build_on(topology, examples)
        options = replace(options, example_inputs=build_on[0])
    return Job(topology, auto, options, build_on)


def options_fit(options: EngineOptions, plan: Plan) -> None:
    """Refuse options the plan would ignore or cannot run."""
    for option, value, form in (
        ("tp_plan", options.tp_plan, "tp"),
        ("pp_split", options.pp_split, "pp"),
    ):
        if value is not None and getattr(plan, form) == 1:  # it would be ignored: say so
            raise MeshfitError(
                f"{option} is for {form} > 1, and plan {plan} has {form}=1; add "
                f"{form}=N to the plan (e.g. '{form}=2'), or drop {option}"
            )
    if options.compile and plan.pp > 1 and plan.schedule == "zero-bubble":
        # measured: torch's zero-bubble runs backward twice over each stage (input
        # gradients, then weight gradients, retain_graph=True), and a compiled block's
        # backward is one fused function that refuses a second pass
        raise MeshfitError(
            "compile=True does not combine with schedule='zero-bubble': it splits each "
            "block's backward into input and weight gradients, which a compiled block "
            "computes in one piece; use schedule='interleaved-1f1b' with compile=True, "
            "or compile=False"
        )


def auto_requested(plan: Any) -> str | None:
    """The "auto..." text when `plan` (or, for plan=None, `meshfit run --plan`) asks the
    planner to choose; None otherwise."""
    if plan is None:
        plan = os.environ.get("MESHFIT_PLAN")
    return plan if is_auto(plan) else None


def _choose_auto(
    model: nn.Module, plan: str, options: EngineOptions, examples: Examples | None
) -> Any:
    """The planner's choice for `plan` ("auto..."), profiled on two samples of the user's
    data (`examples`), else on parallelize's example_inputs (one global batch)."""
    from meshfit.planner.auto import choose_plan

    targets = None
    if examples is not None:
        batch = examples.first(2)
        if batch is None:
            raise MeshfitError("plan='auto' needs at least one sample in the dataset to plan on")
        inputs, targets = batch
        batch_size = examples.batch_size
        if options.example_inputs is not None:
            inputs = options.example_inputs
    else:
        inputs = options.example_inputs
        found = tensors_in(inputs) if inputs is not None else []
        if not found:
            raise MeshfitError(
                "parallelize(model, 'auto') needs example_inputs=: one global batch of the "
                "model's inputs (its size is the batch the planner plans for); or use "
                "mf.fit(..., plan='auto'), which takes them from the dataset"
            )
        batch_size = found[0].shape[0]
    return choose_plan(
        model,
        plan,
        batch_size=batch_size,
        example_inputs=inputs,
        example_targets=targets,
        loss_fn=options.loss_fn,
        optimizer=options.optimizer,
        compiled=options.compile,
        chunked_loss=options.chunked_loss,
    )


def one_microbatch_for_batchnorm(
    model: nn.Module, plan: Plan, options: EngineOptions
) -> tuple[Plan, str | None]:
    """A pipeline plan that leaves the micro-batches and schedule to meshfit, for a
    model with BatchNorm: one micro-batch under GPipe, the only pipeline run in which
    BatchNorm normalises over the whole batch as one process does (and a line saying so).
    A plan that sets either is kept, and refused later if it cuts the batch."""
    if not plan.leaves_pipeline_open or not options.sync_batchnorm:
        return plan, None
    from meshfit.parallel.batchnorm import batchnorm_layers

    layers = batchnorm_layers(model)
    if not layers:
        return plan, None
    note = (
        f"one micro-batch per step under GPipe (microbatches=1,schedule=gpipe): layer "
        f"{layers[0][0]!r} is a {type(layers[0][1]).__name__}, which normalises over the whole "
        f"batch, as in one process; the stages take turns rather than overlap"
    )
    return replace(plan, microbatches=1, schedule="gpipe"), note


def as_plan(plan: Plan | str | None) -> Plan:
    """The Plan of `plan`; None is `meshfit run --plan`'s (MESHFIT_PLAN), else dp over
    every process. A plan given in code that differs from --plan's is refused."""
    given = os.environ.get("MESHFIT_PLAN")
    if auto_requested(given):  # the planner chose `plan` for --plan auto
        given = None
    from_command = Plan.parse(given) if given else None
    if plan is None:
        return from_command or Plan()
    if isinstance(plan, str):
        plan = Plan.parse(plan)
    if not isinstance(plan, Plan):
        raise MeshfitError(f"plan must be a Plan or text such as 'dp=2', not {type(plan).__name__}")
    if from_command is not None and from_command != plan:
        raise MeshfitError(
            f"the script asks for plan {plan} and meshfit run --plan for {from_command}; "
            f"drop one (plan=None in the script takes the command line's)"
        )
    return plan
