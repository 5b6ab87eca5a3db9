"""Runners: one per way of running a step, behind one small interface (the Strategy idea
of Lightning Fabric). The Engine drives a Runner and never asks which one it has.

- `LocalRunner`: the whole model (or its tensor-parallel / data-parallel wrapping) runs
  forward and backward in this process, micro-batch after micro-batch, with gradient
  synchronisation only after the last one.
- `parallel.pipeline.PipelineRunner`: torch.distributed.pipelining's schedule runs the
  micro-batches over the stages.

Both return the mean loss over this rank's share of the batch; the Engine averages it
over the data-parallel ranks and steps the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.precision import Precision
from meshfit.trees import map_tensors


class Runner(Protocol):
    eval_microbatches: int  # how many parts evaluate cuts this rank's share into

    def train(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward and backward over this rank's share; gradients are then ready for
        the optimizer (synchronised across data-parallel ranks). Returns the mean loss
        over the share."""
        ...

    def evaluate(self, inputs: Any, targets: Any) -> torch.Tensor:
        """The mean loss over this rank's share, without gradients."""
        ...

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state from this rank's (full-tensor) state dict."""
        ...


class LocalRunner:
    """Forward and backward of the whole model in this process, cut into micro-batches.

    Why the numbers match one process: each micro-batch loss is a mean over an equal
    number of samples and is scaled by 1/microbatches; DDP/FSDP2 average gradients over
    the data-parallel ranks, so the gradient is the gradient of the global-batch mean.
    """

    eval_microbatches = 1

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], Any],
        precision: Precision,
        microbatches: int,
        forward_loss: Callable[[nn.Module, Any, Any], Any] | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.precision = precision
        self.microbatches = microbatches
        # what computes the loss of a micro-batch: forward + loss_fn (compiled, when asked)
        self.forward_loss = forward_loss or (lambda m, x, y: loss_fn(m(x), y))
        self._loss_checked = False

    def train(self, inputs: Any, targets: Any) -> torch.Tensor:
        micro = self.microbatches
        if micro == 1:  # the common case, without the accumulation's extra kernels
            with self.precision.autocast():
                loss = self._loss(inputs, targets)
            self.precision.backward(loss)
            return reported(loss)
        chunk = _batch_len(inputs) // micro
        total = None
        for i in range(micro):
            x = _slice(inputs, i * chunk, (i + 1) * chunk)
            y = _slice(targets, i * chunk, (i + 1) * chunk)
            with self._grad_sync(enabled=i == micro - 1), self.precision.autocast():
                scaled = self._loss(x, y) / micro
            self.precision.backward(scaled)
            total = reported(scaled) if total is None else total + reported(scaled)
        return total

    def evaluate(self, inputs: Any, targets: Any) -> torch.Tensor:
        with self.precision.autocast():
            return reported(self._loss(inputs, targets))

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return local  # this rank's full-tensor state dict is the whole model's

    def _loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        loss = self.forward_loss(self.model, inputs, targets)
        if not self._loss_checked:
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise MeshfitError(
                    f"loss_fn must return one number, the mean loss over the batch, but it "
                    f"returned {shape}; use a mean reduction (e.g. reduction='mean')"
                )
            self._loss_checked = True
        return loss

    def _grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch
        (gradient accumulation): DDP's no_sync, FSDP2's set_requires_gradient_sync."""
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if enabled or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()


def reported(loss: torch.Tensor) -> torch.Tensor:
    """A loss as step/evaluate return it: detached, at least float32 (a bf16 loss is
    widened; a float64 one keeps its precision, which the float64 equivalence tests
    need)."""
    return loss.detach().to(torch.promote_types(loss.dtype, torch.float32))


def _batch_len(tree: Any) -> int:
    from meshfit.trees import tensors_in

    return tensors_in(tree)[0].shape[0]


def _slice(tree: Any, start: int, stop: int) -> Any:
    return map_tensors(tree, lambda t: t[start:stop])
