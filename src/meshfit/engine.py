"""Engine: one training step for any plan, plus evaluation and checkpoints.

`mf.parallelize(model, plan, optimizer=..., loss_fn=...)` builds an Engine. `step(batch)`
takes the GLOBAL batch (the same on every rank), keeps this rank's share, cuts it into
micro-batches, runs forward and backward on each, lets the parallel wrappers synchronise
gradients, clips, and steps the optimizer. The loss it returns is the mean over the
global batch, identical on every rank.

Why the numbers match one process: each micro-batch loss is a mean over an equal number
of samples and is scaled by 1/microbatches; DDP averages gradients over the dp ranks, so
the gradient is the gradient of the global-batch mean, as in a single process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.mesh import build_mesh, env_world_size, init_distributed, is_distributed
from meshfit.parallel.compose import ParallelOptions, apply_plan
from meshfit.plan import Plan
from meshfit.trees import map_tensors, tensors_in

if TYPE_CHECKING:
    from meshfit.parallel.tensor import TPPlan

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
LossFn = Callable[[Any, Any], torch.Tensor]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW(lr=3e-4): what meshfit uses when no optimizer is given; the fused CUDA
    kernel when every parameter is on a GPU (one launch per step instead of several per
    tensor)."""
    params = list(params)
    on_gpu = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=3e-4, fused=on_gpu or None)


class Engine:
    """A model parallelized by a Plan, with its optimizer. Build one with `parallelize`."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        grad_clip: float | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        compile: bool = False,
        tp_plan: TPPlan | None = None,
        pp_split: list[int] | None = None,
        example_inputs: Any = None,
    ) -> None:
        from meshfit.checkpoint import model_fingerprint

        self.module = model  # the user's model, unwrapped
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.device = init_distributed(alone=plan.offload)  # offload runs on FSDP2
        self.plan = plan.resolve(env_world_size())
        self.plan.validate()  # again: dp is known only now
        self.world_size = self.plan.world_size or 1
        self.rank = dist.get_rank() if is_distributed() else 0
        self.fingerprint = model_fingerprint(model)  # before wrapping: global shapes, user names
        self.num_parameters = sum(p.numel() for p in model.parameters())  # whole model
        self.mesh = build_mesh(self.plan, self.device)
        self._autocast_dtype = _AUTOCAST_DTYPES.get(self.plan.precision)
        options = ParallelOptions(loss_fn=loss_fn, autocast=self._autocast, tp_plan=tp_plan,
                                  pp_split=pp_split, example_inputs=example_inputs)  # fmt: skip
        self.model, self.pipeline = apply_plan(model, self.plan, self.mesh, self.device, options)
        self.optimizer = _build_optimizer(optimizer, self.model)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler else None
        self.step_count = 0  # optimizer steps taken (restored by load)
        self.last_grad_norm: torch.Tensor | None = None
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.plan.precision == "fp16" else None
        )
        dims = self.mesh.mesh_dim_names if self.mesh is not None else ()
        # The batch is split over replicated (dp) and sharded (fsdp) data parallel ranks.
        self._data_groups = [
            self.mesh.get_group(d) for d in ("dp", "fsdp") if d in dims and self.mesh[d].size() > 1
        ]
        self.dp_size = self.plan.data_parallel_size
        self.dp_rank = 0
        for d in ("dp", "fsdp"):
            if d in dims:
                self.dp_rank = self.dp_rank * self.mesh.size(
                    dims.index(d)
                ) + self.mesh.get_local_rank(d)
        # Ranks that hold disjoint parameters: their gradient norms add up.
        self._norm_groups = [self.mesh.get_group("pp")] if "pp" in dims else []
        self._sharded = self.plan.tp > 1 or self.plan.pp > 1 or self.plan.uses_fsdp
        self._loss_checked = False
        self._gradient_bytes: int | None = None  # measured at the optimizer step, on request
        self._measure_gradients = False
        # torch.compile over forward + loss together, so the loss (often a large
        # cross-entropy over the vocabulary) fuses with the last layers.
        self._forward_loss = torch.compile(self._forward_loss) if compile else self._forward_loss

    # ---- training ----------------------------------------------------------------
    def step(self, batch: tuple[Any, Any]) -> torch.Tensor:
        """One training step on the GLOBAL batch `(inputs, targets)`; returns the
        global mean loss as a 0-dim tensor (the same on every rank; `float(loss)`
        reads it, which waits for the device)."""
        inputs, targets = self.local_share(batch, self.plan.num_microbatches)
        return self.step_local(inputs, targets)

    def step_local(self, inputs: Any, targets: Any) -> torch.Tensor:
        """A training step on this rank's share of the global batch (what `fit` feeds;
        every dp rank must pass an equal share)."""
        if not self.model.training:  # train() walks every module: only when it changes
            self.model.train()
        inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
        micro = self.plan.num_microbatches
        size = _batch_size(inputs, "inputs")
        if size % micro:
            raise MeshfitError(
                f"this rank's {size} samples do not split into {micro} micro-batches; "
                f"make the global batch a multiple of {micro * self.dp_size}"
            )
        if self.pipeline is not None:  # the schedule runs every micro-batch
            loss = self.pipeline.run(inputs, targets, train=True)
            self._optimizer_step()
            return self._global_mean(loss)
        if micro == 1:  # the common case, without the accumulation's extra kernels
            with self._autocast():
                loss = self._loss(inputs, targets)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            self._optimizer_step()
            return self._global_mean(_reported(loss))
        chunk = size // micro
        total = None
        for i in range(micro):
            x = _slice(inputs, i * chunk, (i + 1) * chunk)
            y = _slice(targets, i * chunk, (i + 1) * chunk)
            last = i == micro - 1
            with self._grad_sync(enabled=last), self._autocast():
                loss = self._loss(x, y)
                scaled = loss / micro
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total = _reported(scaled) if total is None else total + _reported(scaled)
        self._optimizer_step()
        return self._global_mean(total)

    def _optimizer_step(self) -> None:
        if self._measure_gradients:
            self._gradient_bytes = sum(_local_bytes(p.grad) for p in self.model.parameters()
                                       if p.grad is not None)  # fmt: skip
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip is not None and self._sharded:
            from meshfit.parallel.grad_norm import clip_grad_norm

            self.last_grad_norm = clip_grad_norm(
                self.model.parameters(), self.grad_clip, self._norm_groups
            )
        elif self.grad_clip is not None:
            # Gradients are already synchronised here, so the local norm is the global norm.
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.grad_clip
            )
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1

    @torch.no_grad()
    def evaluate(self, batch: tuple[Any, Any]) -> torch.Tensor:
        """Mean loss over the GLOBAL batch without training; the same on every rank."""
        micro = self.plan.num_microbatches if self.pipeline is not None else 1
        inputs, targets = self.local_share(batch, micro)
        return self.evaluate_local(inputs, targets)

    @torch.no_grad()
    def evaluate_local(self, inputs: Any, targets: Any) -> torch.Tensor:
        self.model.eval()
        inputs, targets = _to_device(inputs, self.device), _to_device(targets, self.device)
        if self.pipeline is not None:
            loss = self.pipeline.run(inputs, targets, train=False)
            self.model.train()
            return self._global_mean(loss)
        with self._autocast():
            loss = _reported(self._loss(inputs, targets))
        self.model.train()
        return self._global_mean(loss)

    # ---- batch handling ----------------------------------------------------------
    def local_share(self, batch: tuple[Any, Any], microbatches: int) -> tuple[Any, Any]:
        """This rank's contiguous share of a global batch, after checking it divides."""
        inputs, targets = unpack_batch(batch)
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

    # ---- checkpoints -------------------------------------------------------------
    def save(self, path: str, *, extra: dict[str, Any] | None = None) -> str:
        """Save model, optimizer and progress to the directory `path` (DCP, written
        aside then committed, so a crash never leaves a half checkpoint there)."""
        from meshfit.checkpoint import save_checkpoint

        return save_checkpoint(self, path, extra=extra)

    def load(self, path: str) -> dict[str, Any]:
        """Load a checkpoint saved by `save` (or the newest one under a checkpoint root
        written by `fit`); works across plans of the same model. Returns its metadata."""
        from meshfit.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def memory_report(self) -> dict[str, int | None]:
        """This rank's memory, in bytes: its share of the parameters, of the gradients
        (as they were at the last optimizer step; None until a step after the first
        call), of the optimizer state, and the device's peak allocation on a GPU (None
        on the CPU, where the first three are the model state)."""
        self._measure_gradients = True
        params = sum(_local_bytes(p) for p in self.model.parameters())
        optim = sum(
            _local_bytes(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0  # not Adam's step counter
        )
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {"parameters": params, "gradients": self._gradient_bytes, "optimizer": optim,
                "peak_device": peak}  # fmt: skip

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state under its own names, as full CPU tensors, on every
        rank: tensor-parallel shards are gathered and pipeline stages merged. For
        exporting or comparing weights (it holds the whole model in CPU memory)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        if self.mesh is None:
            local = self.model.state_dict()
        else:
            local = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        local = {k: v.detach().cpu().clone() for k, v in local.items()}
        if self.pipeline is None:
            return local
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(
            self.pipeline.group
        )
        dist.all_gather_object(parts, local, group=self.pipeline.group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part or {})
        return merged

    # ---- internals ---------------------------------------------------------------
    def _forward_loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        return self.loss_fn(self.model(inputs), targets)

    def _loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        loss = self._forward_loss(inputs, targets)
        if not self._loss_checked:
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise MeshfitError(
                    f"loss_fn must return one number, the mean loss over the batch, but it "
                    f"returned {shape}; use a mean reduction (e.g. reduction='mean')"
                )
            self._loss_checked = True
        return loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    def _grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch
        (gradient accumulation): DDP's no_sync, FSDP2's set_requires_gradient_sync."""
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if enabled or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _global_mean(self, local_mean: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return local_mean
        total = local_mean.clone()
        for group in self._data_groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total / self.dp_size


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
) -> Engine:
    """Split `model` over this job's processes as `plan` says and return an Engine.

    plan: a Plan, its text form ("dp=4"), or None for data parallel over every process.
    optimizer: a function from parameters to an optimizer, e.g.
        ``lambda params: torch.optim.AdamW(params, lr=3e-4)`` (default: AdamW, lr 3e-4).
        A function, not an optimizer, because parallel forms may replace the parameters.
    loss_fn: ``loss_fn(model(inputs), targets)`` -> mean loss over the batch.
    grad_clip: clip the global gradient norm to this value.
    lr_scheduler: a function from the optimizer to a torch LR scheduler, stepped once per
        training step.
    compile: run forward and loss through ``torch.compile`` (off by default: the first
        steps then take longer while it compiles; on a GPU the rest are faster).
    tp_plan: for tp > 1, ``{module name or pattern: "colwise" | "rowwise"}`` instead of
        the plan meshfit derives from the blocks.
    pp_split: for pp > 1, the block indices where stages 2, 3, ... begin, instead of
        the balanced cut meshfit chooses.
    example_inputs: one micro-batch of inputs; with pp > 1 meshfit times each block
        on it and balances the stages by measured time (else by parameter count).
    """
    if not isinstance(model, nn.Module):
        raise MeshfitError(f"parallelize needs a torch.nn.Module, not {type(model).__name__}")
    if loss_fn is None:
        raise MeshfitError(
            "parallelize needs a loss function: pass loss_fn=..., e.g. "
            "loss_fn=torch.nn.functional.cross_entropy"
        )
    if not callable(loss_fn):
        raise MeshfitError(f"loss_fn must be callable, not {type(loss_fn).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise MeshfitError(
            "pass the optimizer as a function of the parameters, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4): parallel forms "
            "may replace the model's parameters, so meshfit builds the optimizer itself"
        )
    if optimizer is not None and not callable(optimizer):
        raise MeshfitError(f"optimizer must be a function of the parameters, not {optimizer!r}")
    if grad_clip is not None and not grad_clip > 0:
        raise MeshfitError(f"grad_clip must be a positive number, not {grad_clip!r}")
    plan = as_plan(plan)
    plan.validate()
    return Engine(
        model,
        plan,
        optimizer=optimizer or default_optimizer,
        loss_fn=loss_fn,
        grad_clip=grad_clip,
        lr_scheduler=lr_scheduler,
        compile=compile,
        tp_plan=tp_plan,
        pp_split=pp_split,
        example_inputs=example_inputs,
    )


def as_plan(plan: Plan | str | None) -> Plan:
    if plan is None:
        return Plan()
    if isinstance(plan, str):
        return Plan.parse(plan)
    if isinstance(plan, Plan):
        return plan
    raise MeshfitError(f"plan must be a Plan or text such as 'dp=2', not {type(plan).__name__}")


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


def _reported(loss: torch.Tensor) -> torch.Tensor:
    """A loss as step/evaluate return it: detached, at least float32 (a bf16 loss is
    widened; a float64 one keeps its precision, which the float64 equivalence tests
    need)."""
    return loss.detach().to(torch.promote_types(loss.dtype, torch.float32))


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
