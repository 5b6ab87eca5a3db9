"""Engine: one training step for any plan, plus evaluation and checkpoints.

`mf.parallelize(model, plan, optimizer=..., loss_fn=...)` builds an Engine. `step(batch)`
takes the GLOBAL batch (the same on every rank), keeps this rank's share, hands it to
the runner (forward and backward over micro-batches, gradient synchronisation), clips,
and steps the optimizer. The loss it returns is the mean over the global batch,
identical on every rank.

Layers (docs/architecture.md): the Plan becomes a Topology (mesh, groups, this rank's
place), `parallel.compose.apply_plan` applies the forms and picks the Runner, Precision
holds autocast / FSDP2 policy / gradient scaler, and the Engine drives them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshfit.coupling.batch import BatchCoupling
from meshfit.errors import MeshfitError
from meshfit.launch import watchdog
from meshfit.losses import ModelOwnLoss, SampleSum, global_token_mean, normalise_by_count
from meshfit.metrics import MetricTap, reduce_metrics
from meshfit.options import EngineOptions, OptimizerFactory, SchedulerFactory
from meshfit.parallel.compose import FormOptions, apply_plan
from meshfit.parallel.ddp import StepUndo, find_unused_where_missing, on_any_rank, replicas_in
from meshfit.runtime.batch_errors import (
    check_gradients_reached_the_optimizer,
    explain_first_failure,
    warn_on_ignored_targets,
)
from meshfit.runtime.batches import (
    batch_size,
    check_microbatches,
    local_share,
    split_batch,
    to_device,
)
from meshfit.runtime.examples import BuildExample, of_the_first_batch
from meshfit.runtime.precision import Precision
from meshfit.runtime.prediction import predict_global_batch
from meshfit.state.checkpoint import (
    TrainingState,
    gather_full_state,
    load_checkpoint,
    model_fingerprint,
    save_checkpoint,
)
from meshfit.topology import Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class _Built:
    """What the plan's forms made of the user's model, and the optimizer over it."""

    parallel_model: nn.Module
    runner: Any
    tp_report: Any
    own_hooks: Any
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any


class Engine:
    """A model parallelized by a Plan, with its optimizer. Build one with `parallelize`."""

    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        options: EngineOptions,
        build_on: BuildExample | None = None,
    ) -> None:
        self.user_model = model  # the user's model (its parameters may be sharded)
        self.model_class = type(model).__name__  # before FSDP2 renames the class
        self.topology = topology
        self.plan = topology.plan
        self.device = topology.device
        self.options = options
        self.loss_fn = options.loss_fn
        self.grad_clip = options.grad_clip
        self.fingerprint = model_fingerprint(model)  # before wrapping: global shapes, user names
        self.num_parameters = sum(p.numel() for p in model.parameters())  # whole model
        # said beside the batch when the first step fails on a dtype (batch_errors.py)
        self._model_dtype = next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), None
        )
        self.planned: Any = None  # plan="auto": the planner's choice and its prediction
        self.precision = Precision(self.plan.precision, self.device)
        self.model_loss = ModelOwnLoss(model) if options.loss_fn == "model" else None
        # a transformers model that keeps a cache unless told (use_cache in its config)
        self._keeps_cache = bool(getattr(getattr(model, "config", None), "use_cache", False))
        # a sum over the samples, or a user's mean over real targets: made exact (SampleSum)
        self.sample_sum = SampleSum(
            self.model_loss or options.loss_fn,
            decide_from_halves=self.plan.pp > 1
            and topology.batch_parts > 1
            and self.model_loss is None,  # a user's loss_fn, which can take parts
            agree=topology.batch_max,
            counts_allowed=self.plan.cp == 1,
        )
        splits = topology.batch_parts > 1 or topology.grad_average_size > 1
        self.sample_sum.on = bool(self.model_loss and self.model_loss.sums_samples and splits)
        loss_fn = self.sample_sum
        # Metrics are computed beside the loss, where the loss is (metrics.py).
        self.metric_tap = MetricTap(loss_fn, options.metrics) if options.metrics else None
        loss_fn = self.metric_tap or loss_fn
        self.last_metrics: dict[str, torch.Tensor] = {}  # of the last step / evaluation
        # what couples the samples of a batch, and the scope each micro-batch runs in
        self.coupling = BatchCoupling(
            model, topology, self.model_loss, own_statistics=not options.sync_batchnorm
        )
        self._forms = FormOptions(
            loss_fn=loss_fn,
            tp_plan=options.tp_plan,
            pp_split=options.pp_split,
            example_inputs=options.example_inputs,
            sync_batchnorm=options.sync_batchnorm,
            compile=options.compile,
            init=options.init,
            weights=options.weights,
            chunked_loss=options.chunked_loss,
            fp8_recipe=options.fp8_recipe,
            fp8_head=options.fp8_head,
        )
        self._built: _Built | None = None
        # tp and pp are shown an example: fit's data (`build_on`), example_inputs, or the
        # first batch given (the forms, optimizer, scheduler built then: made-up inputs
        # fail vision models, a UNet's timestep, OPT's cut; what reads them before does)
        if build_on is not None and build_on[0] is not None:
            self._build(*build_on)
        elif options.example_inputs is not None or (self.plan.tp == 1 and self.plan.pp == 1):
            self._build(options.example_inputs)
        self.step_count = 0  # optimizer steps taken (restored by load)
        self.last_grad_norm: torch.Tensor | None = None
        self._batch_checked = False  # until a training step has worked
        self._coupling_checked = self._checked_in_training = False  # (_check_coupling)
        self._said: set[str] = set()  # the probe's start-up lines, said once
        self._evaluated = False  # until an evaluation has worked
        # the global item count of the last evaluation of a (sum, count) loss (None for
        # a mean): what weighs its batch in a mean over several (fit's eval loss)
        self.last_eval_count: torch.Tensor | None = None
        self._gradient_bytes: int | None = None  # measured at the optimizer step, on request
        self._measure_gradients = False

    # ---- the split model, built on the example or the first batch ---------------------
    def _build(self, inputs: Any, targets: Any = None, asked: Any = None) -> _Built:
        if self._built is None:
            forms = replace(self._forms, example_inputs=inputs, example_targets=targets)
            forms = replace(forms, question_batch=asked)  # pp's questions: to_build_on
            with watchdog.phase("setup", "setup (the model's split, on the first batch)"):
                parts = apply_plan(
                    self.user_model, self.topology, self.precision, forms, self.coupling
                )
            optimizer = _build_optimizer(self.options.optimizer, parts[0])
            scheduler = _build_scheduler(self.options.lr_scheduler, optimizer)
            self._built = _Built(*parts, optimizer, scheduler)
        return self._built

    def _build_on(self, inputs: Any, targets: Any = None) -> None:
        """Build on the first global batch (every rank holds it): runtime/examples.py."""
        if self._built is None:
            self._build(*of_the_first_batch(self.topology, inputs, targets))

    @property
    def parallel_model(self) -> nn.Module:
        """What runs forward: the user's model under the plan's forms."""
        return self._build(None).parallel_model

    @property
    def runner(self) -> Any:
        return self._build(None).runner

    @property
    def tp_report(self) -> Any:
        return self._build(None).tp_report

    @property
    def own_hooks(self) -> Any:
        return self._build(None).own_hooks

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._build(None).optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self._build(None).lr_scheduler

    # ---- what the topology knows -------------------------------------------------
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.topology.mesh

    @property
    def dp_size(self) -> int:
        """How many ways the global batch is split: dp x fsdp."""
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's share of the global batch, 0 .. dp_size - 1."""
        return self.topology.dp_rank

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def module(self) -> nn.Module:
        warnings.warn("engine.module is now engine.user_model", DeprecationWarning, stacklevel=2)
        return self.user_model

    @property
    def model(self) -> nn.Module:
        what = "what runs forward; the model you passed is engine.user_model"
        warnings.warn(f"engine.model is now engine.parallel_model ({what})", DeprecationWarning, 2)
        return self.parallel_model

    # ---- training ----------------------------------------------------------------
    def step(self, batch: Any) -> torch.Tensor:
        """One training step on the GLOBAL batch `(inputs, targets)` (with
        loss_fn="model": the mapping the model takes, labels included); returns the
        global mean loss as a 0-dim tensor (the same on every rank; `float(loss)`
        reads it, which waits for the device)."""
        self._build_on(*self.split_batch(batch))
        inputs, targets = self.local_share(batch, self.plan.num_microbatches)
        return self.step_local(inputs, targets)

    def step_local(self, inputs: Any, targets: Any) -> torch.Tensor:
        """A training step on this rank's share of the global batch (what `fit` feeds;
        every dp rank must pass an equal share)."""
        step = self.step_count + 1
        with watchdog.phase("step", f"training step {step}", step=step):
            return self._train_step(inputs, targets)

    def _train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        if not self.parallel_model.training:  # train() walks every module: only on change
            self.parallel_model.train()
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        rows = batch_size(inputs, "inputs")
        check_microbatches(rows, self.plan, self.dp_size)
        self.sample_sum.global_rows = rows * self.topology.grad_average_size
        self._check_coupling(inputs, targets)
        self.coupling.count_step(inputs, targets, self.plan.num_microbatches)
        first = not self._batch_checked
        replicas = self._replicas() if first else []
        undo = StepUndo.taken(self._stepped_modules()) if replicas else None
        try:
            with explain_first_failure(first, "training step", inputs, targets, self._model_dtype):
                loss, count = self.runner.train(inputs, targets)
        except BaseException:
            # Gradients of micro-batches that ran before the failure: the next step
            # would add its own to them.
            self.optimizer.zero_grad(set_to_none=True)
            if self.metric_tap is not None:
                self.metric_tap.calls.clear()
            raise
        if self.metric_tap is not None:
            self.last_metrics = reduce_metrics(
                self.metric_tap, self.plan.num_microbatches, self.runner, self.topology
            )
        if not self._batch_checked:
            self._batch_checked = True
            verdict = self.coupling.verdict
            if count is None and not (verdict is not None and verdict.per_sample):
                warn_on_ignored_targets(targets, self.topology)
            unused = check_gradients_reached_the_optimizer(
                self.optimizer,
                self.parallel_model,
                self.plan,
                self.model_class,
                self.rank,
                under_ddp=bool(replicas),
            )
            if replicas and on_any_rank(bool(unused), self.device):
                loss, count = self._again_finding_unused(replicas, unused, undo, inputs, targets)
        if count is None:
            loss = self.topology.batch_mean(loss)
        else:
            divisor = self.runner.sum_gradient_divisor
            loss = normalise_by_count(loss, count, self.topology, self.parallel_model, divisor)
        self._optimizer_step()
        return loss

    def _replicas(self) -> list[nn.Module]:
        """This rank's DDP wrappers (the whole model's, or each pipeline stage's)."""
        return replicas_in(self._stepped_modules())

    def _stepped_modules(self) -> list[nn.Module]:
        stages = [s.submod for s in getattr(self.runner, "stages", [])]
        return [self.parallel_model, *stages]

    def _again_finding_unused(
        self, replicas: list[Any], unused: list[str], undo: StepUndo, inputs: Any, targets: Any
    ) -> tuple[torch.Tensor, Any]:
        """Parameters got no gradient in the first step under DDP (a head the loss never
        uses: DINOv2's mask_token, ESM's contact head): DDP's buckets holding them never
        reduced, and torch stopped the next step ("Expected to have finished reduction
        in the prior iteration") after an update from unreduced gradients. Before any
        update, DDP is rebuilt to find unused parameters at every step (as Hugging Face's
        Trainer builds it by default) and the step runs again from the same random state
        and buffers: the one-process run."""
        find_unused_where_missing(replicas, self.device)  # before the gradients go: it reads them
        self.optimizer.zero_grad(set_to_none=True)
        undo.restore()
        if self.metric_tap is not None:
            self.metric_tap.calls.clear()
        if self.rank == 0:
            listed = ", ".join(unused[:5]) + (", ..." if len(unused) > 5 else "")
            which = (
                f"{len(unused)} trainable parameter(s) ({listed})"
                if unused
                else "trainable parameters of another pipeline stage"
            )
            print(
                f"meshfit: {which} got no gradient in the first step: data parallel (DDP) now "
                f"looks for unused parameters at every step where they are "
                f"(find_unused_parameters=True, one pass over the autograd graph a step) and "
                f"ran the step again; freeze them (requires_grad_(False)) to skip that pass",
                flush=True,
            )
        result = self.runner.train(inputs, targets)
        if self.metric_tap is not None:  # the step's metrics are this run's
            self.last_metrics = reduce_metrics(
                self.metric_tap, self.plan.num_microbatches, self.runner, self.topology
            )
        return result

    def _check_coupling(self, inputs: Any, targets: Any, what: str = "training step") -> None:
        """The coupling probe on this rank's first samples (coupling/probe.py): a coupled
        loss is made global or refused before training, what was made global said once. At
        the first evaluation if one comes first, and at the first training step with the
        statistics question: a training forward may couple samples or update buffers."""
        training = what == "training step"
        if self._checked_in_training or (self._coupling_checked and not training):
            return
        loss_of = self.runner.probe_loss()
        if loss_of is None:
            return
        low = self.plan.precision != "fp32" or self._model_dtype in (torch.bfloat16, torch.float16)
        with explain_first_failure(True, what, inputs, targets, self._model_dtype):
            self.coupling.check_first_batch(
                self.user_model, loss_of, inputs, targets, low, statistics=training
            )
        self._coupling_checked = True
        self._checked_in_training = training
        self.sample_sum.take(self.coupling.verdict)  # a sum or a mean over real targets
        for note in self.coupling.notes():
            if self.rank == 0 and note not in self._said:
                print(f"meshfit: {note}", flush=True)
            self._said.add(note)

    def _optimizer_step(self) -> None:
        if self._measure_gradients:
            self._gradient_bytes = gradient_bytes(self.parallel_model)
        self.precision.unscale(self.optimizer)
        if self.grad_clip is not None:
            counted = self.runner.counted_elsewhere()
            self.last_grad_norm = clip_gradients(
                self.parallel_model, self.grad_clip, self.topology, counted
            )
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1

    @torch.no_grad()
    def evaluate(self, batch: Any) -> torch.Tensor:
        """Mean loss over the GLOBAL batch without training; the same on every rank."""
        self._build_on(*self.split_batch(batch))
        inputs, targets = self.local_share(batch, self.runner.eval_microbatches)
        return self.evaluate_local(inputs, targets)

    @torch.no_grad()
    def evaluate_local(self, inputs: Any, targets: Any) -> torch.Tensor:
        with _on_every_rank("evaluate", "evaluate", f"evaluation after step {self.step_count}"):
            return self._evaluate(inputs, targets)

    def _evaluate(self, inputs: Any, targets: Any) -> torch.Tensor:
        self.parallel_model.eval()
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        # an evaluation before any step: a coupled loss must be global here too (before,
        # in-batch negatives under dp=2 evaluated to 1.997 where one process has 2.669)
        rows = batch_size(inputs, "inputs")
        self.sample_sum.global_rows = rows * self.topology.grad_average_size
        self._check_coupling(inputs, targets, "evaluation")
        self.coupling.count_step(inputs, targets, self.runner.eval_microbatches)
        try:
            with explain_first_failure(
                not self._evaluated, "evaluation", inputs, targets, self._model_dtype
            ):
                loss, count = self.runner.evaluate(inputs, targets)
        finally:
            self.parallel_model.train()
        self._evaluated = True
        if self.metric_tap is not None:
            self.last_metrics = reduce_metrics(
                self.metric_tap, self.runner.eval_microbatches, self.runner, self.topology
            )
        if count is None:
            self.last_eval_count = None
            return self.topology.batch_mean(loss)
        mean, self.last_eval_count = global_token_mean(loss, count, self.topology)
        return mean

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets) of a batch as this engine's loss takes it: a pair, or with
        loss_fn="model" the model's mapping (plus what meshfit passes to its loss) and
        its labels."""
        inputs, targets = split_batch(batch, self.model_loss is not None)
        if self.model_loss is not None:
            inputs = {**inputs, **self.model_loss.model_kwargs()}
        if self._keeps_cache and isinstance(inputs, Mapping) and "position_ids" in inputs:
            # transformers keeps packed documents apart (position_ids restarting) only
            # without a cache, which training never reads: measured, a Llama's packed row
            # attended across its documents (0.06 in its logits) with the default cache
            inputs = {"use_cache": False, **inputs}
        return inputs, targets

    def local_share(self, batch: Any, microbatches: int) -> tuple[Any, Any]:
        """This rank's contiguous share of a global batch, after checking it divides."""
        return local_share(*self.split_batch(batch), self.topology, microbatches)

    def predict(self, inputs: Any) -> Any:
        """The model's outputs on the GLOBAL batch `inputs` (a tensor, or a mapping the
        model takes as keywords), gathered whole on every rank as CPU tensors, in the
        model's own form; no gradients, evaluation mode. Every rank calls it."""
        self._build_on(inputs)
        with _on_every_rank("predict", "evaluate", f"prediction after step {self.step_count}"):
            return predict_global_batch(
                self.parallel_model, self.runner, self.topology, self.precision, inputs
            )

    # ---- checkpoints -------------------------------------------------------------
    def save(self, path: str, *, extra: dict[str, Any] | None = None) -> str:
        """Save model, optimizer and progress to the directory `path` (DCP, written
        aside then committed, so a crash never leaves a half checkpoint there)."""
        with _on_every_rank("save", "save", f"the save of {path}"):
            return save_checkpoint(self.training_state(), path, extra=extra)

    def save_model(self, path: str, max_shard_size: int | str = "5GB") -> str | None:
        """Write the whole model (from any plan) as safetensors to `path`: a directory
        (model.safetensors, or Hugging Face-style shards of at most `max_shard_size` with
        their index; plus config.json for a Hugging Face model: from_pretrained and
        weights= load it), streamed tensor by tensor so no process holds more than one
        file of it; or one .safetensors file. Call it on every rank; returns the file
        (the index, for shards) on rank 0."""
        from meshfit.state.export import ModelState, save_model

        state = ModelState(
            module=self.parallel_model,
            runner=self.runner,
            own_hooks=self.own_hooks,
            device=self.device,
            distributed=self.mesh is not None,
            config=getattr(self.user_model, "config", None),
        )
        with _on_every_rank("save_model", "save", f"the save_model of {path}"):
            return save_model(state, path, max_shard_size)

    def load(self, path: str) -> dict[str, Any]:
        """Load a checkpoint saved by `save` (or the newest one under a checkpoint root
        written by `fit`); works across plans of the same model. Returns its metadata."""
        with watchdog.phase("load", f"the load of {path}"):
            meta = load_checkpoint(self.training_state(), path)
        self.step_count = int(meta["step"])
        return meta

    def training_state(self) -> TrainingState:
        """The parts of this run a checkpoint saves and restores."""
        return TrainingState(
            self.parallel_model, self.optimizer, self.scaler, self.lr_scheduler, self.runner,
            self.fingerprint, self.plan, self.step_count, self.rank, self.world_size, self.own_hooks,
        )  # fmt: skip

    def memory_report(self) -> dict[str, int | None]:
        """This rank's memory, in bytes: its share of the parameters, of the gradients
        (as they were at the last optimizer step; None until a step after the first
        call), of the optimizer state, and the device's peak allocation on a GPU (None
        on the CPU, where the first three are the model state)."""
        self._measure_gradients = True
        cuda = self.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
        params, optim = model_state_bytes(self.parallel_model, self.optimizer)
        return {"parameters": params, "gradients": self._gradient_bytes, "optimizer": optim,
                "peak_device": peak}  # fmt: skip

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state under its own names, as full CPU tensors, on every
        rank: tensor-parallel shards are gathered and pipeline stages merged. For
        exporting or comparing weights (it holds the whole model in CPU memory)."""
        gathering = f"gathering the full state after step {self.step_count}"
        with _on_every_rank("full_state_dict", "gather", gathering):
            model, runner = self.parallel_model, self.runner
            return gather_full_state(model, self.mesh is not None, runner, self.own_hooks)


@contextlib.contextmanager
def _on_every_rank(call: str, kind: str, doing: str) -> Iterator[None]:
    """engine.`call`, a collective, as the watchdog's phase `kind` doing `doing` (marked
    with the call, so a hang verdict can say "not under a rank guard"); a failure because
    other ranks never called it (a rank guard, as other trainers' saves take) is said in
    one line (watchdog's explain_one_sided_call), not as gloo's or NCCL's lost
    connection."""
    with watchdog.phase(kind, doing, call=call):
        try:
            yield
        except MeshfitError:
            raise
        except Exception as exc:
            line = watchdog.explain_one_sided_call(call, exc)
            if line is None:
                raise
            raise MeshfitError(line) from exc


def _build_optimizer(factory: OptimizerFactory, model: nn.Module) -> torch.optim.Optimizer:
    optimizer = factory(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MeshfitError(
            f"the optimizer function returned {type(optimizer).__name__}, not a "
            f"torch.optim.Optimizer; return e.g. torch.optim.AdamW(params, lr=3e-4)"
        )
    return optimizer


def _build_scheduler(factory: SchedulerFactory | None, optimizer: torch.optim.Optimizer) -> Any:
    if factory is None:
        return None
    scheduler = factory(optimizer)
    # What the engine calls on it: step() each step, state_dict() at each checkpoint.
    if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict")):
        raise MeshfitError(
            f"the lr_scheduler function returned {type(scheduler).__name__}, not a scheduler "
            f"(with step() and state_dict()); return e.g. "
            f"torch.optim.lr_scheduler.StepLR(optimizer, 100)"
        )
    return scheduler


# Kept here rather than imported from memory_probe / grad_norm: those load DTensor
# (and sympy) at import, which `import meshfit` avoids (tests/test_import.py).
def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard, for a DTensor)."""
    from torch.distributed.tensor import DTensor  # on use: it loads sympy (see above)

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients this rank holds now."""
    return sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameters, optimizer state): bytes this rank holds of each (optimizer state
    without scalar entries such as Adam's step counter)."""
    params = sum(_local_bytes(p) for p in model.parameters())
    optim = sum(
        _local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )
    return params, optim


def clip_gradients(
    model: nn.Module, max_norm: float, topology: Topology, counted_elsewhere: set[int]
) -> torch.Tensor:
    """Clip `model`'s gradients to the global norm `max_norm`; return that norm. Where
    every rank holds the whole, synchronised gradient (dp), the local norm is the global
    one (torch's own clip); else parallel/grad_norm.py reduces it over the ranks."""
    if not topology.gradients_split:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    from meshfit.parallel.grad_norm import clip_grad_norm

    return clip_grad_norm(
        model.parameters(), max_norm, topology.pipeline_groups, counted_elsewhere=counted_elsewhere
    )
