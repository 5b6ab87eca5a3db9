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

import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshfit import watchdog
from meshfit.batch_errors import explain_first_failure
from meshfit.errors import MeshfitError
from meshfit.losses import ModelOwnLoss
from meshfit.metrics import MetricTap, check_metrics, reduce_metrics
from meshfit.parallel.compose import apply_plan
from meshfit.plan import Plan, is_auto
from meshfit.precision import Precision
from meshfit.topology import Topology
from meshfit.trees import call_model, map_tensors, tensors_in

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshfit.parallel.pipeline import PipelineRunner
    from meshfit.parallel.tensor import TPPlan

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW(lr=3e-4): what meshfit uses when no optimizer is given; the fused CUDA
    kernel when every parameter is on a GPU (one launch per step instead of several per
    tensor)."""
    params = list(params)
    on_gpu = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=3e-4, fused=on_gpu or None)


@dataclass
class EngineOptions:
    """Everything `parallelize` takes besides the model and the plan (see its docstring);
    `fit` passes its extra keywords through to it, so each option is listed once."""

    loss_fn: LossFn | str  # a function, or "model" for the model's own loss
    optimizer: OptimizerFactory = default_optimizer
    grad_clip: float | None = None
    lr_scheduler: SchedulerFactory | None = None
    compile: bool = False
    tp_plan: TPPlan | None = None
    pp_split: list[int] | None = None
    example_inputs: Any = None
    sync_batchnorm: bool = True
    metrics: dict[str, Any] | None = None
    init: Any = None  # for a model on meta: materialize.py's init passes
    weights: str | None = None  # pretrained safetensors to load (materialize.WeightFiles)


class Engine:
    """A model parallelized by a Plan, with its optimizer. Build one with `parallelize`."""

    def __init__(self, model: nn.Module, topology: Topology, options: EngineOptions) -> None:
        from meshfit.checkpoint import model_fingerprint

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
        self.planned: Any = None  # plan="auto": the planner's choice and its prediction
        self.precision = Precision(self.plan.precision, self.device)
        self.model_loss = ModelOwnLoss(model) if options.loss_fn == "model" else None
        loss_fn = self.model_loss or options.loss_fn
        # Metrics are computed beside the loss, where the loss is (metrics.py).
        self.metric_tap = MetricTap(loss_fn, options.metrics) if options.metrics else None
        loss_fn = self.metric_tap or loss_fn
        self.last_metrics: dict[str, torch.Tensor] = {}  # of the last step / evaluation

        def forward_loss(module: nn.Module, inputs: Any, targets: Any) -> Any:
            return loss_fn(call_model(module, inputs), targets)

        # torch.compile over forward + loss together, so the loss (often a large
        # cross-entropy over the vocabulary) fuses with the last layers; under pp each
        # block compiles instead (parallel/compiled.py says why).
        if options.compile and self.plan.tp > 1:
            from meshfit.parallel.compiled import graphs_per_rank

            graphs_per_rank()
        self.parallel_model, self.runner = apply_plan(
            model,
            topology,
            self.precision,
            loss_fn=loss_fn,
            forward_loss=torch.compile(forward_loss) if options.compile else forward_loss,
            tp_plan=options.tp_plan,
            pp_split=options.pp_split,
            example_inputs=options.example_inputs,
            sync_batchnorm=options.sync_batchnorm,
            compile_blocks=options.compile and self.plan.pp > 1,
            init=options.init,
            weights=options.weights,
        )
        self.optimizer = _build_optimizer(options.optimizer, self.parallel_model)
        self.lr_scheduler = _build_scheduler(options.lr_scheduler, self.optimizer)
        self.step_count = 0  # optimizer steps taken (restored by load)
        self.last_grad_norm: torch.Tensor | None = None
        self._batch_checked = False  # until a training step has worked
        self._evaluated = False  # until an evaluation has worked
        # the global item count of the last evaluation of a (sum, count) loss (None for
        # a mean): what weighs its batch in a mean over several (fit's eval loss)
        self.last_eval_count: torch.Tensor | None = None
        self._gradient_bytes: int | None = None  # measured at the optimizer step, on request
        self._measure_gradients = False

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
    def pipeline(self) -> PipelineRunner | None:
        """The pipeline runner under a plan with pp > 1 (its cut: `describe()`)."""
        return None if self.plan.pp == 1 else self.runner  # type: ignore[return-value]

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def module(self) -> nn.Module:
        warnings.warn("engine.module is now engine.user_model", DeprecationWarning, stacklevel=2)
        return self.user_model

    @property
    def model(self) -> nn.Module:
        warnings.warn(
            "engine.model is now engine.parallel_model (what runs forward; the model you "
            "passed is engine.user_model)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.parallel_model

    # ---- training ----------------------------------------------------------------
    def step(self, batch: Any) -> torch.Tensor:
        """One training step on the GLOBAL batch `(inputs, targets)` (with
        loss_fn="model": the mapping the model takes, labels included); returns the
        global mean loss as a 0-dim tensor (the same on every rank; `float(loss)`
        reads it, which waits for the device)."""
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
        inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
        micro = self.plan.num_microbatches
        size = _batch_size(inputs, "inputs")
        if size % micro:
            raise MeshfitError(
                f"this rank's {size} samples do not split into {micro} micro-batches; "
                f"make the global batch a multiple of {micro * self.dp_size}"
            )
        try:
            with explain_first_failure(not self._batch_checked, "training step", inputs, targets):
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
                self.metric_tap, self.plan.num_microbatches, self, self.pipeline
            )
        if not self._batch_checked:
            self._batch_checked = True
            if count is None:
                self._warn_on_ignored_targets(targets)
            self._check_gradients_reached_the_optimizer()
        if count is None:
            loss = self.topology.batch_mean(loss)
        else:
            loss = self._normalise_by_count(loss, count)
        self._optimizer_step()
        return loss

    def _check_gradients_reached_the_optimizer(self) -> None:
        """Before the first update: the parameters the optimizer steps must be the ones
        the model computed with. A model whose layers keep their own references to
        their weights (Keras layers do) computes with the originals after FSDP2 or
        DTensor replaced them, and its optimizer would step parameters no loss reaches:
        measured, a Keras model under fsdp=2 trained another run with no error."""
        params = [
            p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad
        ]
        missing = [p for p in params if p.grad is None]
        if not params or not missing:
            return
        names = {id(p): n for n, p in self.parallel_model.named_parameters()}
        if len(missing) == len(params):
            self.optimizer.zero_grad(set_to_none=True)
            raise MeshfitError(
                f"the first training step gave none of the {len(params)} parameters under "
                f"plan {self.plan} a gradient: {self.model_class} computes "
                f"with other tensors than the ones the plan put in its modules (its layers "
                f"keep their own references to their weights, as Keras layers do, which "
                f"{'FSDP2' if self.plan.uses_fsdp else 'the plan'} replaces). Use a plan "
                f"that keeps the parameters in place (dp), or a model whose layers read "
                f"their weights from the module"
            )
        if self.rank == 0:
            listed = ", ".join(names.get(id(p), "?") for p in missing[:5])
            warnings.warn(
                f"{len(missing)} of {len(params)} trainable parameters got no gradient in "
                f"the first training step ({listed}{', ...' if len(missing) > 5 else ''}): "
                f"unused by this loss, or computed around the plan's parameters. If they get "
                f"one in a single process, the plan lost them: check with mf.verify",
                stacklevel=4,
            )

    def _normalise_by_count(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """For a (sum, count) loss: the global mean, sum over the global batch / count over
        the global batch, and the gradients of exactly that.

        The runner backpropagated each micro-batch's sum unscaled; the data-parallel
        wrappers averaged the gradients over the dp_size ranks and the pipeline schedule
        divided them by its micro-batch count. One all-reduce of (sum, count) later, the
        gradients are scaled by dp_size * divisor / count: the gradient of the global
        token mean, as in one process, however the tokens fall on ranks and
        micro-batches. No second forward; float64 keeps counts exact."""
        mean, items = self._global_token_mean(loss_sum, count)
        factor = self.dp_size * self.runner.sum_gradient_divisor / items.clamp_min(1)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self.parallel_model.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        with torch.no_grad():  # one kernel per device and dtype
            for (device, dtype), grads in groups.items():
                torch._foreach_mul_(grads, factor.to(device, dtype))
        return mean

    def _global_token_mean(
        self, loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(global sum / global count, global count) of this rank's (sum, count): one
        all-reduce, in float64 (exact counts); a batch with nothing to count has loss 0."""
        local = torch.stack([loss_sum.double(), count.double()])
        total, items = self.topology.batch_sum(local).unbind()
        return (total / items.clamp_min(1)).to(loss_sum.dtype), items

    def _warn_on_ignored_targets(self, targets: Any) -> None:
        """A mean loss over targets with -100 (ignored) entries weighs tokens unequally
        once the batch is split into ranks or micro-batches: say so once, with the fix."""
        split = self.dp_size * self.plan.num_microbatches > 1
        if split and any(
            not t.is_floating_point() and bool((t == -100).any()) for t in tensors_in(targets)
        ):
            warnings.warn(
                "the targets hold -100 (ignored) entries and the batch is split over "
                f"{self.dp_size} rank(s) x {self.plan.num_microbatches} micro-batch(es): a "
                "loss_fn that returns a mean weighs the real tokens of each part by that "
                "part's count, not the global one, so the run differs from one process. "
                "Return a pair (loss_sum, count) instead, e.g. "
                "loss_fn=mf.losses.cross_entropy(ignore_index=-100)",
                stacklevel=4,
            )

    def _optimizer_step(self) -> None:
        if self._measure_gradients:
            self._gradient_bytes = sum(
                _local_bytes(p.grad) for p in self.parallel_model.parameters() if p.grad is not None
            )
        self.precision.unscale(self.optimizer)
        if self.grad_clip is not None:
            self.last_grad_norm = self._clip_gradients(self.grad_clip)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        params = self.parallel_model.parameters()
        if not self.topology.gradients_split:
            # Gradients are already synchronised here, so the local norm is the global one.
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        from meshfit.parallel.grad_norm import clip_grad_norm

        return clip_grad_norm(
            params,
            max_norm,
            self.topology.pipeline_groups,
            counted_elsewhere=self.runner.counted_elsewhere(),
        )

    @torch.no_grad()
    def evaluate(self, batch: Any) -> torch.Tensor:
        """Mean loss over the GLOBAL batch without training; the same on every rank."""
        inputs, targets = self.local_share(batch, self.runner.eval_microbatches)
        return self.evaluate_local(inputs, targets)

    @torch.no_grad()
    def evaluate_local(self, inputs: Any, targets: Any) -> torch.Tensor:
        with watchdog.phase("evaluate", f"evaluation after step {self.step_count}"):
            return self._evaluate(inputs, targets)

    def _evaluate(self, inputs: Any, targets: Any) -> torch.Tensor:
        self.parallel_model.eval()
        inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
        try:
            with explain_first_failure(not self._evaluated, "evaluation", inputs, targets):
                loss, count = self.runner.evaluate(inputs, targets)
        finally:
            self.parallel_model.train()
        self._evaluated = True
        if self.metric_tap is not None:
            self.last_metrics = reduce_metrics(
                self.metric_tap, self.runner.eval_microbatches, self, self.pipeline
            )
        if count is None:
            self.last_eval_count = None
            return self.topology.batch_mean(loss)
        mean, self.last_eval_count = self._global_token_mean(loss, count)
        return mean

    # ---- batch handling ----------------------------------------------------------
    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets) of a batch as this engine's loss takes it: a pair, or with
        loss_fn="model" the model's mapping (plus what meshfit passes to its loss) and
        its labels."""
        inputs, targets = split_batch(batch, self.model_loss is not None)
        if self.model_loss is not None:
            inputs = {**inputs, **self.model_loss.model_kwargs()}
        return inputs, targets

    def local_share(self, batch: Any, microbatches: int) -> tuple[Any, Any]:
        """This rank's contiguous share of a global batch, after checking it divides."""
        inputs, targets = self.split_batch(batch)
        size = _batch_size(inputs, "inputs")
        target_size = _batch_size(targets, "targets")
        if target_size != size:
            raise MeshfitError(
                f"inputs hold {size} samples but targets hold {target_size}; "
                f"give one target per input sample"
            )
        check_batch_divides(size, self.dp_size, microbatches)
        if self.dp_size == 1:
            return inputs, targets
        share = size // self.dp_size
        start = self.dp_rank * share
        return _slice(inputs, start, start + share), _slice(targets, start, start + share)

    def predict(self, inputs: Any) -> Any:
        """The model's outputs on the GLOBAL batch `inputs` (a tensor, or a mapping the
        model takes as keywords), gathered whole on every rank as CPU tensors, in the
        model's own form; no gradients, evaluation mode. Every rank calls it."""
        from meshfit.prediction import predict

        with watchdog.phase("evaluate", f"prediction after step {self.step_count}"):
            return predict(self, inputs)

    # ---- checkpoints -------------------------------------------------------------
    def save(self, path: str, *, extra: dict[str, Any] | None = None) -> str:
        """Save model, optimizer and progress to the directory `path` (DCP, written
        aside then committed, so a crash never leaves a half checkpoint there)."""
        from meshfit.checkpoint import save_checkpoint

        with watchdog.phase("save", f"the save of {path}"):
            return save_checkpoint(self, path, extra=extra)

    def save_model(self, path: str, max_shard_size: int | str = "5GB") -> str | None:
        """Write the whole model (from any plan) as safetensors to `path`: a directory
        (model.safetensors, or Hugging Face-style shards of at most `max_shard_size` with
        their index; plus config.json for a Hugging Face model: from_pretrained and
        weights= load it), streamed tensor by tensor so no process holds more than one
        file of it; or one .safetensors file. Call it on every rank; returns the file
        (the index, for shards) on rank 0."""
        from meshfit.export import save_model

        return save_model(self, path, max_shard_size)

    def load(self, path: str) -> dict[str, Any]:
        """Load a checkpoint saved by `save` (or the newest one under a checkpoint root
        written by `fit`); works across plans of the same model. Returns its metadata."""
        from meshfit.checkpoint import load_checkpoint

        with watchdog.phase("load", f"the load of {path}"):
            return load_checkpoint(self, path)

    def memory_report(self) -> dict[str, int | None]:
        """This rank's memory, in bytes: its share of the parameters, of the gradients
        (as they were at the last optimizer step; None until a step after the first
        call), of the optimizer state, and the device's peak allocation on a GPU (None
        on the CPU, where the first three are the model state)."""
        self._measure_gradients = True
        params = sum(_local_bytes(p) for p in self.parallel_model.parameters())
        optim = sum(
            _local_bytes(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0  # not Adam's step counter
        )
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {
            "parameters": params,
            "gradients": self._gradient_bytes,
            "optimizer": optim,
            "peak_device": peak,
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state under its own names, as full CPU tensors, on every
        rank: tensor-parallel shards are gathered and pipeline stages merged. For
        exporting or comparing weights (it holds the whole model in CPU memory)."""
        with watchdog.phase("gather", f"gathering the full state after step {self.step_count}"):
            return self._full_state_dict()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        if self.mesh is None:
            local = self.parallel_model.state_dict()
        else:
            options = StateDictOptions(full_state_dict=True)
            local = get_model_state_dict(self.parallel_model, options=options)
        local = {k: v.detach().cpu().clone() for k, v in local.items()}
        return self.runner.gather_state(local)


def parallelize(
    model: nn.Module,
    plan: Plan | str | Topology | None = None,
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
) -> Engine:
    """Split `model` over this job's processes as `plan` says and return an Engine.

    plan: a Plan, its text form ("dp=4"), or None for data parallel over every process
        (or a Topology built from one: `fit` builds it first to size its example batch).
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
        forward FLOPs on it and balances the stages by them (else by parameter count), and
        checks the cut on it on every rank before training; with tp > 1 it traces the
        blocks on it (else on an input it makes up).
    sync_batchnorm: BatchNorm layers normalise with the statistics of the whole global
        batch, over the data-parallel ranks, as in one process (default). A BatchNorm
        model is then refused with more than one micro-batch, which BatchNorm would
        normalise one by one. False: each rank and micro-batch uses its own statistics
        (no communication; not the one-process run).
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
        With a model built on meta each rank reads only the slices it keeps.
    """
    if not isinstance(model, nn.Module):
        raise MeshfitError(f"parallelize needs a torch.nn.Module, not {type(model).__name__}")
    if loss_fn is None:
        raise MeshfitError(
            "parallelize needs a loss function: pass loss_fn=..., e.g. "
            "loss_fn=torch.nn.functional.cross_entropy"
        )
    if not callable(loss_fn) and loss_fn != "model":
        raise MeshfitError(
            f"loss_fn must be callable, or 'model' for the model's own loss, not "
            f"{type(loss_fn).__name__}"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        raise MeshfitError(
            "pass the optimizer as a function of the parameters, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4): parallel forms "
            "may replace the model's parameters, so meshfit builds the optimizer itself"
        )
    if optimizer is not None and not callable(optimizer):
        raise MeshfitError(f"optimizer must be a function of the parameters, not {optimizer!r}")
    if grad_clip is not None and not (
        isinstance(grad_clip, numbers.Real) and not isinstance(grad_clip, bool) and grad_clip > 0
    ):
        raise MeshfitError(f"grad_clip must be a positive number, not {grad_clip!r}")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise MeshfitError(
            f"lr_scheduler must be a function of the optimizer, e.g. lambda optimizer: "
            f"torch.optim.lr_scheduler.StepLR(optimizer, 100), not {lr_scheduler!r}"
        )
    if not isinstance(compile, bool):
        raise MeshfitError(f"compile must be True or False, not {compile!r}")
    if not isinstance(sync_batchnorm, bool):
        raise MeshfitError(f"sync_batchnorm must be True or False, not {sync_batchnorm!r}")
    if blocks is not None:
        if not isinstance(blocks, str):
            raise MeshfitError(
                f"blocks must be the name of the container of the model's blocks, e.g. "
                f"'model.layers', not {blocks!r}"
            )
        from meshfit.parallel.blocks import use_blocks

        use_blocks(model, blocks)
    auto = None
    if auto_requested(plan):
        auto = _choose_auto(
            model, auto_requested(plan), example_inputs, loss_fn, optimizer, compile
        )
        plan = auto.plan
    topology = plan if isinstance(plan, Topology) else create_topology(plan)
    for option, value, form in (("tp_plan", tp_plan, "tp"), ("pp_split", pp_split, "pp")):
        degree = getattr(topology.plan, form)
        if value is not None and degree == 1:  # it would be ignored: say so
            raise MeshfitError(
                f"{option} is for {form} > 1, and plan {topology.plan} has {form}=1; add "
                f"{form}=N to the plan (e.g. '{form}=2'), or drop {option}"
            )
    if compile and topology.plan.pp > 1 and topology.plan.schedule == "zero-bubble":
        # measured: torch's zero-bubble runs backward twice over each stage (input
        # gradients, then weight gradients, retain_graph=True), and a compiled block's
        # backward is one fused function that refuses a second pass
        raise MeshfitError(
            "compile=True does not combine with schedule='zero-bubble': it splits each "
            "block's backward into input and weight gradients, which a compiled block "
            "computes in one piece; use schedule='interleaved-1f1b' with compile=True, "
            "or compile=False"
        )
    options = EngineOptions(
        loss_fn=loss_fn,
        optimizer=optimizer or default_optimizer,
        grad_clip=grad_clip,
        lr_scheduler=lr_scheduler,
        compile=compile,
        tp_plan=tp_plan,
        pp_split=pp_split,
        example_inputs=example_inputs,
        sync_batchnorm=sync_batchnorm,
        metrics=check_metrics(metrics),
        init=init,
        weights=_weights_path(weights),
    )
    engine = Engine(model, topology, options)
    if auto is not None:
        engine.planned = auto
        if engine.rank == 0:
            print(f"meshfit: {auto.describe()}", flush=True)
    watchdog.mark("script", "the training script before step 1", waiting=False)
    return engine


def _weights_path(weights: Any) -> str | None:
    """The weights to load: `weights`, else `meshfit run --weights` (MESHFIT_WEIGHTS)."""
    if weights is None:
        return os.environ.get("MESHFIT_WEIGHTS")
    if not isinstance(weights, (str, os.PathLike)):
        raise MeshfitError(f"weights must be a path to safetensors, not {weights!r}")
    return os.fspath(weights)


def auto_requested(plan: Any) -> str | None:
    """The "auto..." text when `plan` (or, for plan=None, `meshfit run --plan`) asks the
    planner to choose; None otherwise."""
    if plan is None:
        plan = os.environ.get("MESHFIT_PLAN")
    return plan if is_auto(plan) else None


def _choose_auto(
    model: nn.Module, plan: str, example_inputs: Any, loss_fn: Any, optimizer: Any, compiled: bool
) -> Any:
    from meshfit.planner.auto import choose_plan

    found = tensors_in(example_inputs) if example_inputs is not None else []
    if not found:
        raise MeshfitError(
            "parallelize(model, 'auto') needs example_inputs=: one global batch of the "
            "model's inputs (its size is the batch the planner plans for); or use "
            "mf.fit(..., plan='auto'), which takes them from the dataset"
        )
    return choose_plan(
        model,
        plan,
        batch_size=found[0].shape[0],
        example_inputs=example_inputs,
        loss_fn=loss_fn,
        optimizer=optimizer,
        compiled=compiled,
    )


def create_topology(plan: Plan | str | None) -> Topology:
    """Check `plan`, start the process group and build the Topology of this job."""
    plan = as_plan(plan)
    plan.validate()
    return Topology.create(plan)


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


def check_batch_divides(batch_size: int, dp_size: int, microbatches: int) -> None:
    """Refuse a global batch that does not split evenly over ranks and micro-batches."""
    unit = dp_size * microbatches
    if batch_size < 1 or batch_size % unit:
        lower = (batch_size // unit) * unit
        options = [str(n) for n in (lower, lower + unit) if n > 0]
        raise MeshfitError(
            f"a global batch of {batch_size} samples does not split over {dp_size} "
            f"data-parallel rank(s) x {microbatches} micro-batch(es) (needs a multiple of "
            f"{unit}); use a batch size of {' or '.join(options)}"
        )


def split_batch(batch: Any, model_loss: bool = False) -> tuple[Any, Any]:
    """(inputs, targets) of a batch: a pair as it is; for loss_fn="model" the mapping the
    model takes (inputs) and its labels (targets, for counting)."""
    if model_loss:
        if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), torch.Tensor):
            raise MeshfitError(
                f"with loss_fn='model' a batch is the mapping the model takes, labels "
                f"included (e.g. a data collator's dict with input_ids, attention_mask and "
                f"labels), not {type(batch).__name__}"
                + ("" if not isinstance(batch, Mapping) else " without 'labels'")
            )
        return batch, batch["labels"]
    return unpack_batch(batch)


def unpack_batch(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise MeshfitError(
            f"a batch must be a pair (inputs, targets), not {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    return batch[0], batch[1]


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


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard, for a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor, without importing it
    return local.numel() * local.element_size()


def _batch_size(tree: Any, what: str) -> int:
    tensors = tensors_in(tree)
    if not tensors or tensors[0].ndim == 0:
        raise MeshfitError(
            f"{what} must be a tensor (or tuple/dict of tensors) whose first dimension is the batch"
        )
    size = tensors[0].shape[0]
    for t in tensors[1:]:
        if t.ndim == 0 or t.shape[0] != size:
            raise MeshfitError(f"the tensors in {what} disagree on the batch size (dim 0)")
    return size


def _slice(tree: Any, start: int, stop: int) -> Any:
    return map_tensors(tree, lambda t: t[start:stop])


def _to_device(tree: Any, device: torch.device) -> Any:
    return map_tensors(tree, lambda t: t.to(device, non_blocking=True))
