"""Running the stages: torch.distributed.pipelining's schedules, fed by meshfit.

The schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble) and all point-to-point
communication are PyTorch's; this module builds the PipelineStages from the stage
modules, picks the schedule class and runs one pass of it per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_map_only

from meshfit.coupling.batch import BatchCoupling
from meshfit.coupling.stages import StageQuestions
from meshfit.errors import MeshfitError
from meshfit.losses import split_loss
from meshfit.parallel.pipeline.costs import StageCosts, stage_costs_of
from meshfit.parallel.pipeline.cut import PipelineSplit
from meshfit.parallel.pipeline.stage import OutputForm, _in_torch_metadata_inference
from meshfit.parallel.pipeline.tied import TiedWeights
from meshfit.plan import SCHEDULE_TABLE
from meshfit.runtime.runners import LocalLoss
from meshfit.trees import tensors_in


def reported_dtype(model: nn.Module) -> torch.dtype:
    """The dtype losses are reported in: the model's floating dtype, at least float32
    (a float64 model reports float64 losses; a bf16 one float32)."""
    for p in model.parameters():
        if p.is_floating_point():
            return torch.promote_types(p.dtype, torch.float32)
    return torch.float32


@dataclass
class PipelineRunner:
    """Runs one step of the pipeline schedule over this rank's share of the batch: the
    runner of a plan with pp > 1 (`runners.LocalRunner` runs the others)."""

    model: nn.Module  # the user's model, pruned to this rank's stages
    stages: list[PipelineStage]
    schedule: Any
    group: dist.ProcessGroup
    has_first: bool
    has_last: bool
    starts: list[int]  # first block index of every stage
    costs: StageCosts
    block_names: list[str]
    microbatches: int
    stage_loss: _StageLoss
    tied: TiedWeights | None = None  # weights the first and the last stage both hold
    coupling: BatchCoupling | None = None  # the scope each step's forward and loss run in
    sequence: Any = None  # context parallel's hook (parallel/context/)
    experts: Any = None  # expert parallel's gradients, reduced after the step (experts.py)
    head_deferred: bool = False  # chunked_loss=True: the LM head defers to the loss (head_loss.py)
    pair_loss: bool | None = None  # whether loss_fn returns (sum, count); known after a step
    foreign_state: frozenset[str] = frozenset()  # state keys another stage owns
    sequence_checked: bool = False  # context parallel's first-step probe is done

    @property
    def sum_gradient_divisor(self) -> int:
        """The schedule divides gradients by the micro-batch count (scale_grads)."""
        return self.microbatches

    @property
    def eval_microbatches(self) -> int:
        """Evaluation runs the schedule too, so its batch splits like a training one."""
        return self.microbatches

    @property
    def pipeline_cut(self) -> list[int]:
        return list(self.starts)

    def from_loss_rank(self, local: torch.Tensor) -> None:
        dist.broadcast(local, src=self.last_rank, group=self.group)

    @property
    def last_rank(self) -> int:
        """Global rank that holds the last stage (where the loss is)."""
        return dist.get_global_rank(self.group, dist.get_world_size(self.group) - 1)

    def describe(self) -> str:
        bounds = [*self.starts, len(self.block_names)]
        totals = stage_costs_of(self.costs, self.starts)
        parts = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            cost = (
                f"{totals[i] / 1e6:.2f} MFLOP"
                if self.costs.unit == "flops"
                else f"{totals[i] / 1e6:.2f}M params"
            )
            parts.append(f"stage {i}: blocks {a}-{b - 1} ({cost})")
        how = "forward FLOPs" if self.costs.unit == "flops" else "parameter count"
        return f"pipeline cut by {how}: " + "; ".join(parts)

    def train(self, inputs: Any, targets: Any) -> LocalLoss:
        """Forward and backward of every micro-batch; gradients are then ready (the
        schedule scales them and triggers the data-parallel reduction)."""
        result = self._run(inputs, targets, train=True)
        if self.tied is not None:
            self.tied.sum_gradients()
        if self.experts is not None:
            self.experts.reduce_gradients()
        return result

    def probe_loss(self) -> None:
        return None  # the schedule runs whole micro-batches only

    def counted_elsewhere(self) -> set[int]:
        """The last stage's copies of tied weights: the first stage counts their gradient
        in the norm."""
        return self.tied.last_stage_copies() if self.tied is not None else set()

    def evaluate(self, inputs: Any, targets: Any) -> LocalLoss:
        return self._run(inputs, targets, train=False)

    def predict(self, inputs: Any) -> Any:
        """The model's outputs on this rank's share (forward only, through the schedule),
        in the model's own form, on every rank of the pipeline (the last stage has them
        and broadcasts them)."""
        if self.sequence is not None:
            raise MeshfitError(
                "predict under context parallel is not built yet (each rank holds its "
                "tokens' outputs); predict with a plan without cp, or load the checkpoint "
                "in one process"
            )
        first = tensors_in(inputs)[0]
        args = (first,) if self.has_first else ()
        # torch's schedule calls the loss on the last stage whatever: a stand-in target
        # it can cut into micro-batches, and a loss that is not computed.
        target = torch.zeros(first.shape[0], device=first.device) if self.has_last else None
        self.stage_loss.predicting = True
        try:
            merged = self.schedule.eval(*args, target=target, model_inputs=inputs)
        finally:
            self.stage_loss.predicting = False
        outputs = [None]
        if self.has_last:
            form = _unwrapped_form(self.stages[-1])
            outputs[0] = tree_map_only(
                torch.Tensor, lambda t: t.detach().cpu(), form.restore(merged)
            )
        dist.broadcast_object_list(outputs, src=self.last_rank, group=self.group)
        return outputs[0]

    def owned_state(self, local: dict[str, Any]) -> dict[str, Any]:
        """This rank's state dict less what another stage owns (see PipelineSplit)."""
        return {k: v for k, v in local.items() if k not in self.foreign_state}

    def gather_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state from every stage's part, each key from its owner."""
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, self.owned_state(local), group=self.group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part or {})
        return merged

    def _check_the_sequence_cut(self, inputs: Any, targets: Any) -> None:
        """Context parallel's probe (parallel/context/probe.py), through the stages: the
        cut must keep the loss. Without it, a model whose attention meshfit cannot see, or
        a mean loss over masked tokens, trained another run under cp x pp with no word
        (measured: meshfit's GPT with a token-mean loss and -100 targets, 3.4712 against
        one process's 3.4684 at the first step, where cp alone refused it)."""
        from meshfit.parallel.context.probe import check_staged_sequence_split

        left_out = self.coupling.balancing_left_out() if self.coupling is not None else None
        check_staged_sequence_split(self, inputs, targets, left_out)
        self.sequence_checked = True  # not before: a refused step tried again is refused

    def _run(self, inputs: Any, targets: Any, train: bool) -> LocalLoss:
        """One pass of the schedule; returns this rank's share's (mean, None) or (sum,
        count) on every rank of the pipeline."""
        if self.sequence is not None and not self.sequence_checked:  # a step or an evaluation
            self._check_the_sequence_cut(inputs, targets)
        losses: list[torch.Tensor] = []
        self.stage_loss.counts.clear()
        # The batch's inputs reach every stage as a keyword, cut into micro-batches by
        # the schedule; the first stage's positional input is one of their tensors (a
        # stage cannot take a mapping positionally).
        with contextlib.ExitStack() as stack:
            if self.sequence is not None:  # the whole share cut at once: micro-batches are rows
                inputs, targets = self.sequence.local(inputs, targets)
                stack.enter_context(self.sequence.running())
            args = (tensors_in(inputs)[0],) if self.has_first else ()
            target = targets if self.has_last else None
            rows = tensors_in(inputs)[0].shape[0] // self.microbatches
            if self.coupling is not None:
                stack.enter_context(self.coupling.running(rows))
            if self.head_deferred and self.has_last:
                from meshfit.parallel.head_loss import deferred_head

                stack.enter_context(deferred_head())
            # return_outputs=False: else the last stage keeps every micro-batch's output
            # (the logits) until the next step begins and concatenates them into one more
            # copy, which nothing here reads (measured, a 128k-word Llama under pp=2 with 2
            # micro-batches: the last stage's peak 3,037 -> 2,536 MiB, and 1,850 -> 800
            # MiB while the optimizer steps; benchmarks/planner_chunked.py --plans)
            run = self.schedule.step if train else self.schedule.eval
            run(*args, target=target, losses=losses, model_inputs=inputs, return_outputs=False)
        # Only the last stage sees the loss: it broadcasts [loss, count] (count -1 for a
        # mean loss) in float64, which holds counts exactly.
        summary = torch.zeros(2, device=self.stages[0].device, dtype=torch.float64)
        if self.has_last:
            values = torch.stack([x.detach().double() for x in losses])
            # the micro-batches' counts (the first step's shape inference also calls the
            # loss, on a micro-batch it then runs again)
            counts = self.stage_loss.counts[len(self.stage_loss.counts) - len(losses) :]
            summary[0] = values.sum() if counts else values.mean()
            summary[1] = torch.stack(counts).sum() if counts else -1
        dist.broadcast(summary, src=self.last_rank, group=self.group)
        if self.stage_loss.questions is not None:  # before the optimizer steps
            self.stage_loss.questions.settle()
        if self.pair_loss is None:  # learnt once (one host sync), then fixed for the run
            self.pair_loss = bool(summary[1] >= 0)
        return summary[0].to(reported_dtype(self.model)), summary[1] if self.pair_loss else None


def build_pipeline(
    model: nn.Module,
    split: PipelineSplit,
    stage_modules: list[nn.Module],
    *,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device,
    coupling: BatchCoupling | None = None,
    sequence: Any = None,
    experts: Any = None,
    head_deferred: bool = False,
    questions: StageQuestions | None = None,
) -> PipelineRunner:
    """The PipelineStages of this rank's `stage_modules` (one per stage in split.mine,
    already replicated or sharded) and the schedule that runs them; `questions`: the
    coupling question its first pass asks (coupling/stages.py)."""
    stages = [
        _Stage(module, s, split.num_stages, device, group=split.group)
        for s, module in zip(split.mine, stage_modules, strict=True)
    ]
    forms = [_unwrapped(m).output_form for m in stage_modules]
    checked_loss = _StageLoss(loss_fn, forms, questions)
    # the table's entry (plan.SCHEDULE_TABLE; Plan.validate checked its micro-batch rule):
    # torch's class, given one stage or, for the interleaved ones, the rank's stages
    entry = SCHEDULE_TABLE[split.schedule]
    cls = getattr(torch.distributed.pipelining, entry.torch_class)
    runs = stages[0] if entry.virtual_stages == 1 else stages
    sched = cls(runs, microbatches, loss_fn=checked_loss)
    return PipelineRunner(
        model=model,
        stages=stages,
        schedule=sched,
        group=split.group,
        has_first=split.has_first,
        has_last=split.has_last,
        starts=split.starts,
        costs=split.costs,
        block_names=split.block_names,
        microbatches=microbatches,
        stage_loss=checked_loss,
        tied=split.tied,
        foreign_state=split.foreign_state,
        coupling=coupling,
        sequence=sequence,
        experts=experts,
        head_deferred=head_deferred,
    )


class _Stage(PipelineStage):
    """torch's PipelineStage, which in an evaluation (no backward) lets each
    micro-batch's output go once it is sent on (the last stage: once made, the loss
    reading the schedule's own reference): torch keeps it in `fwd_cache` until the next
    step for the backward that never comes, so an evaluation held every micro-batch's
    logits at once (measured: a 128k-word Llama, pp=2 with 8 micro-batches, the last
    stage's evaluate peaked at 947 MiB against the training step's 764; now 571)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last and not self.has_backward:  # the loss gets `output` itself
            self.fwd_cache.pop(fwd_chunk_id, None)
        return output

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.is_last and not self.has_backward:
            return []  # the last stage sends nothing (its cache entry went above)
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.has_backward:  # nothing reads it again (the sends hold their tensors)
            self.fwd_cache.pop(fwd_chunk_id, None)
        return ops


def _unwrapped_form(stage: PipelineStage) -> OutputForm:
    return _unwrapped(stage.submod).output_form


def _unwrapped(module: nn.Module) -> nn.Module:
    """The stage module inside a DDP or fsdp.ReducedPerBlock wrapper (FSDP2 changes the
    module in place)."""
    return getattr(module, "module", module)


class _StageLoss:
    """loss_fn as the schedule calls it on the last stage: on the model's own output
    object (restored from the stage's tensors), returning what is backpropagated (a mean,
    or the sum of a (sum, count) pair, whose count is kept for the runner)."""

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], Any],
        output_forms: list[OutputForm],
        questions: StageQuestions | None = None,
    ):
        self.loss_fn = loss_fn
        self.output_forms = output_forms
        self.counts: list[torch.Tensor] = []
        self.predicting = False  # engine.predict: outputs only, no loss
        self.questions = questions  # the coupling question of the first pass (stages.py)

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self.predicting:
            return torch.zeros((), device=tensors_in(outputs)[0].device)
        form = self.output_forms[-1]  # the last stage's (only the last computes a loss)
        if self.questions is not None and not _in_torch_metadata_inference():
            self.questions.ask_loss(outputs, targets, form.restore)
        loss, count = split_loss(self.loss_fn(form.restore(outputs), targets))
        if count is not None:
            self.counts.append(count)
        return loss
