"""Runners: one per way of running a step, behind one small interface (the Strategy idea
of Lightning Fabric). The Engine drives a Runner and never asks which one it has.

- `LocalRunner`: the whole model (or its tensor-parallel / data-parallel wrapping) runs
  forward and backward in this process, micro-batch after micro-batch, with gradient
  synchronisation only after the last one.
- `parallel.pipeline.PipelineRunner`: torch.distributed.pipelining's schedule runs the
  micro-batches over the stages.

Both return this rank's loss over its share of the batch as `(loss, count)`: a mean and
None for a loss_fn that returns a mean, or a sum and the item count for one that returns
a pair (`losses.py`). The Engine reduces it over the data-parallel ranks (for a pair it
also rescales the gradients, see `Engine._normalise_by_count`) and steps the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from meshfit.coupling.batch import BatchCoupling
from meshfit.errors import MeshfitError
from meshfit.losses import split_loss
from meshfit.runtime.precision import Precision
from meshfit.trees import batch_rows, call_model, slice_rows

LocalLoss = tuple[torch.Tensor, "torch.Tensor | None"]  # (mean, None) or (sum, count)


class Runner(Protocol):
    eval_microbatches: int  # how many parts evaluate cuts this rank's share into
    # For a (sum, count) loss: what the runner divided the summed gradients by (the
    # pipeline schedule divides by the micro-batch count).
    sum_gradient_divisor: int
    # under pp, the first block of every stage (recorded in checkpoints); else None
    pipeline_cut: list[int] | None

    def train(self, inputs: Any, targets: Any) -> LocalLoss:
        """Forward and backward over this rank's share; gradients are then ready for
        the optimizer (synchronised across data-parallel ranks; for a pair, of the
        summed loss). Returns (mean, None) or (sum, count) over the share."""
        ...

    def evaluate(self, inputs: Any, targets: Any) -> LocalLoss:
        """Like train, without gradients."""
        ...

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state from this rank's (full-tensor) state dict."""
        ...

    def owned_state(self, local: dict[str, Any]) -> dict[str, Any]:
        """The entries of this rank's state dict that are its to save (not another
        stage's copy of a module it also runs)."""
        ...

    def counted_elsewhere(self) -> set[int]:
        """ids of this rank's parameters whose gradient another rank holds too and
        counts in the gradient norm (a tied weight's second copy under pp)."""
        ...

    def predict(self, inputs: Any) -> Any:
        """The model's outputs on this rank's share, in the model's own form (eval mode
        and autocast are the caller's)."""
        ...

    def from_loss_rank(self, local: torch.Tensor) -> None:
        """Overwrite `local` (in place) with the value the rank that computed the loss
        holds: metrics and losses are computed where the loss is (the last stage)."""
        ...

    def describe(self) -> str | None:
        """A start-up line on how this runner splits the model (None: nothing to say)."""
        ...

    def probe_loss(self) -> Callable[[Any, Any], LocalLoss] | None:
        """The loss of some of this rank's samples, run as one micro-batch, for the
        coupling probe (coupling/probe.py); None where a step cannot run a part of a
        micro-batch on its own (the pipeline schedule)."""
        ...


class GradientSync(Protocol):
    """How the data-parallel form defers its gradient reduction to a step's last
    micro-batch (Lightning Fabric's _BackwardSyncControl): compose hands the runner the
    one that goes with the wrapped model (ddp.DDPGradientSync, fsdp.FSDPGradientSync)."""

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: its gradients stay local and
        are reduced with the last micro-batch's."""
        ...


class NoGradientSync:
    """One replica: no reduction to defer."""

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class LocalRunner:
    """Forward and backward of the whole model in this process, cut into micro-batches.

    Why the numbers match one process: each micro-batch loss is a mean over an equal
    number of samples and is scaled by 1/microbatches; DDP/FSDP2 average gradients over
    the data-parallel ranks, so the gradient is the gradient of the global-batch mean.
    """

    eval_microbatches = 1
    sum_gradient_divisor = 1  # a pair's sums are backpropagated as they are
    pipeline_cut = None

    def __init__(
        self,
        model: nn.Module,
        forward_loss: Callable[[nn.Module, Any, Any], Any],
        precision: Precision,
        microbatches: int,
        gradient_sync: GradientSync | None = None,
        coupling: BatchCoupling | None = None,
        eager_forward_loss: Callable[[nn.Module, Any, Any], Any] | None = None,
        sequence: Any = None,
        experts: Any = None,
        head_deferred: bool = False,
    ) -> None:
        self.model = model
        self.gradient_sync = gradient_sync or NoGradientSync()
        # what computes a micro-batch's loss: the model's forward and loss_fn together
        # (compiled, when asked)
        self.forward_loss = forward_loss
        # the same, never compiled: the coupling probe runs it on parts of a micro-batch
        self.eager_forward_loss = eager_forward_loss or forward_loss
        self.precision = precision
        self.microbatches = microbatches
        self.coupling = coupling
        # context parallel's hook (parallel/context/): each micro-batch's sequences cut to
        # this rank's tokens, its forward run with attention over the whole sequence
        self.sequence = sequence
        self._sequence_checked = sequence is None
        self._statistics_asked = sequence is None  # at the first training step (cp)
        # expert parallel (parallel/experts.py): its experts' gradients, reduced once the
        # step's last backward is done
        self.experts = experts
        # chunked_loss=True: the LM head defers to the loss inside a step (head_loss.py)
        self.head_deferred = head_deferred

    def train(self, inputs: Any, targets: Any) -> LocalLoss:
        result = self._train(inputs, targets)
        if self.experts is not None:
            self.experts.reduce_gradients()
        return result

    def _check_the_sequence_cut(self, inputs: Any, targets: Any) -> None:
        """Context parallel: the cut must keep the loss (parallel/context/probe.py), at
        the first step or the first evaluation, whichever comes first; at the first step
        after an evaluation again, with the statistics of the tokens (statistics.py)."""
        training = self.model.training  # statistics of the tokens: asked in training
        if self._sequence_checked and (self._statistics_asked or not training):
            return
        from meshfit.parallel.context.probe import check_sequence_split
        from meshfit.parallel.context.statistics import said_token_statistics

        left_out = self.coupling.balancing_left_out() if self.coupling is not None else None
        statistics = check_sequence_split(
            self.model, self.sequence, self.probe_loss(), inputs, targets, left_out
        )
        if training:  # an evaluation's forward updates no buffer: asked again in training
            said_token_statistics(statistics, self.sequence.cp, self.coupling)
            self._statistics_asked = True
        self._sequence_checked = True  # not before: a refused step tried again is refused

    def _train(self, inputs: Any, targets: Any) -> LocalLoss:
        self._check_the_sequence_cut(inputs, targets)
        micro = self.microbatches
        if micro == 1:  # the common case, without the accumulation's extra kernels
            with self.precision.autocast():
                loss, count = self._loss(inputs, targets)
            self.precision.backward(loss)
            return reported(loss), count
        return self._accumulate(inputs, targets, micro)

    def _accumulate(self, inputs: Any, targets: Any, micro: int) -> LocalLoss:
        chunk = batch_rows(inputs) // micro
        total = counted = None
        for i in range(micro):
            x = slice_rows(inputs, i * chunk, (i + 1) * chunk)
            y = slice_rows(targets, i * chunk, (i + 1) * chunk)
            last = i == micro - 1
            with contextlib.nullcontext() if last else self.gradient_sync.deferred():
                with self.precision.autocast():
                    loss, count = self._loss(x, y)
                    if count is None:  # a mean: each micro-batch holds 1/micro of the samples
                        loss = loss / micro
                self.precision.backward(loss)
            total = reported(loss) if total is None else total + reported(loss)
            if count is not None:
                counted = count if counted is None else counted + count
        return total, counted

    def evaluate(self, inputs: Any, targets: Any) -> LocalLoss:
        self._check_the_sequence_cut(inputs, targets)
        with self.precision.autocast():
            loss, count = self._loss(inputs, targets)
        return reported(loss), count

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return local  # this rank's full-tensor state dict is the whole model's

    def owned_state(self, local: dict[str, Any]) -> dict[str, Any]:
        return local

    def counted_elsewhere(self) -> set[int]:
        return set()

    def predict(self, inputs: Any) -> Any:
        if self.sequence is not None:
            raise MeshfitError(
                "predict under context parallel is not built yet (each rank holds its "
                "tokens' outputs); predict with a plan without cp, or load the checkpoint "
                "in one process"
            )
        return call_model(self.model, inputs)

    def from_loss_rank(self, local: torch.Tensor) -> None:
        return None  # every rank computed its own loss

    def describe(self) -> str | None:
        return None

    def probe_loss(self) -> Callable[[Any, Any], LocalLoss]:
        def loss_of(inputs: Any, targets: Any) -> LocalLoss:
            with self.precision.autocast():
                return split_loss(self.eager_forward_loss(self.model, inputs, targets))

        return loss_of

    def _loss(self, inputs: Any, targets: Any) -> LocalLoss:
        with contextlib.ExitStack() as stack:
            if self.sequence is not None:
                inputs, targets = self.sequence.local(inputs, targets)
                stack.enter_context(self.sequence.running())
            if self.coupling is not None:
                stack.enter_context(self.coupling.running(batch_rows(inputs)))
            if self.head_deferred:
                from meshfit.parallel.head_loss import deferred_head

                stack.enter_context(deferred_head())
            return split_loss(self.forward_loss(self.model, inputs, targets))


def reported(loss: torch.Tensor) -> torch.Tensor:
    """A loss as step/evaluate return it: detached, at least float32 (a bf16 loss is
    widened; a float64 one keeps its precision, which the float64 equivalence tests
    need)."""
    return loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
