"""The coupling question a pipeline asks at its first pass, of what the stages ran.

The probe cannot run under a pipeline schedule (its stages run whole micro-batches), so
pp asks it of the whole model before the cut (batch.pipeline_coupling_refusal). Two
runs had no whole model to ask, and trained each micro-batch on its own with no word
where one process trains the batch (measured: ResidualMLP with a loss of the batch's
worst sample under pp=2 with 2 micro-batches, built on example inputs: losses 2.03,
4.66, 2.57 where one process has 2.28, 9.79, 4.95; built on meta: 2.21, 2.28, 2.76
where one process has 2.51, 2.46, 4.32):

- a loss of the user's that couples the samples (a loss of the batch's worst sample)
  where the model is built on `example_inputs` before any batch: the question before
  the cut has no targets, so it asks the forward alone;
- anything that couples them in a model built on meta: no values before the cut.

Here the last stage asks the loss alone, on its first micro-batch's outputs and targets
(the loss of outputs already computed: no model runs), and, for a model built on meta,
every stage asks its own module on its first micro-batch's inputs, each sample's output
squared standing for its loss (batch.per_sample_output). The answer is agreed over
every rank once the schedule's first pass (a step, or an evaluation that comes first)
is over, before the optimizer steps: a refusal leaves the weights as they were.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling.batch import per_sample_output, pipeline_refusal_line, probed_whole
from meshfit.coupling.probe import Verdict
from meshfit.coupling.statistics import note_line, read_by_forward, refusal_line
from meshfit.errors import MeshfitError
from meshfit.losses import split_loss
from meshfit.trees import map_tensors


class StageQuestions:
    """The questions one rank asks at the pipeline's first pass: `loss_fn` (the user's,
    None for the model's own loss, whose question is the forward's) on the last stage,
    and each of `stage_modules` (a model built on meta only; empty otherwise)."""

    def __init__(
        self,
        loss_fn: Any,
        stage_modules: list[nn.Module],
        user_model: nn.Module,
        *,
        plan: Any,
        parts: str,
        low_precision: bool | None,
        own_statistics: bool = False,
    ) -> None:
        self.loss_fn = loss_fn
        self.own_statistics = own_statistics  # sync_batchnorm=False
        self.plan, self.parts, self.low_precision = plan, parts, low_precision
        self.user_model = user_model
        self.model_class = type(user_model).__name__
        self.pending = True  # until a first pass finds nothing (a refused one is asked again)
        self.loss_asked = False
        self.refusal: str | None = None
        self.note: str | None = None  # a statistic no forward reads: said at start-up
        # each stage module's first micro-batch (args, kwargs), detached
        self.calls: dict[int, tuple[Any, Any]] = {}
        self.stage_modules = stage_modules
        self._handles = [
            m.register_forward_pre_hook(self._record, with_kwargs=True) for m in stage_modules
        ]

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        from meshfit.parallel.pipeline.stage import _in_torch_metadata_inference

        if id(module) in self.calls or _in_torch_metadata_inference():
            return
        self.calls[id(module)] = map_tensors((args, kwargs), lambda t: t.detach().clone())

    def ask_loss(self, outputs: Any, targets: Any, restore: Any) -> None:
        """On the last stage's first micro-batch: the loss alone, of `outputs` (the
        stage's tensors; `restore` makes them the model's own output object)."""
        if not self.pending or self.loss_fn is None or self.loss_asked:
            return
        self.loss_asked = True

        def run_loss(x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            return split_loss(self.loss_fn(restore(x), y))

        outputs = map_tensors(outputs, lambda t: t.detach())
        verdict = probed_whole(nn.Module(), run_loss, outputs, targets, None, self.low_precision)
        if verdict is not None and verdict.coupled:
            self.refusal = self._refusal(verdict)

    def settle(self) -> None:
        """After the schedule's first pass, on every rank: each stage module asked (a
        model built on meta), then every rank's answer agreed; a coupling refused. A
        stage's question runs in this process alone (a stage that cannot run a part of
        its micro-batch tells nothing); one sharded by FSDP2 gathers its weights from
        its data-parallel peers, which hold the same stage and ask the same question,
        and one split by tp runs its collectives with its tp peers, which hold the same
        micro-batch and ask the same questions in the same order (a buffer tp split is
        compared whole: statistics._same). Measured: a block subtracting the batch's
        mean in a model on meta under pp=2,tp=2 trained 1.5651, 1.7156, 1.6863 where one
        process has 1.5651, 1.7210, 1.6840 before it was asked here."""
        if not self.pending:
            return
        for module in self.stage_modules:
            call = self.calls.get(id(module))
            if call is not None:  # asked whatever the loss's answer: peers run alike
                self._ask_stage(_StageCall(module, user_model=self.user_model), call)
        said: list[tuple[str | None, str | None]] = [(None, None)] * dist.get_world_size()
        dist.all_gather_object(said, (self.refusal, self.note))
        self.calls.clear()
        self.loss_asked, self.refusal = False, None
        refusal = next((r for r, _ in said if r), None)
        if refusal:  # the engine drops the pass's gradients; a step tried again asks again
            raise MeshfitError(refusal)
        self.pending = False
        for handle in self._handles:
            handle.remove()
        note = next((n for _, n in said if n), None)
        if note and dist.get_rank() == 0:
            print(f"meshfit: {note}", flush=True)

    def _ask_stage(self, stage: _StageCall, call: Any) -> None:
        """One stage module of a model built on meta, on its first micro-batch's inputs:
        a module that mixes the samples, then a buffer its training forward updates from
        them (statistics.py)."""
        run = per_sample_output(stage)
        verdict = probed_whole(stage, run, call, call, None, self.low_precision)
        if verdict is not None and verdict.coupled and self.refusal is None:
            verdict.where = self._user_named(verdict.where)
            self.refusal = self._refusal(verdict)
        try:
            found = read_by_forward(stage, call, low_precision=bool(self.low_precision))
        except Exception:  # noqa: BLE001 - a stage that cannot run a part tells nothing
            return
        if not found.found:
            return
        found.names = [name.removeprefix(_PREFIX) for name in found.names]
        if found.read and not self.own_statistics:
            if self.refusal is None:
                self.refusal = refusal_line(found, self.user_model, self.plan, self.parts, False)
        elif self.note is None:
            self.note = note_line(found, self.plan, self.parts)

    def _user_named(self, where: str | None) -> str | None:
        """The probe's `where` (a name inside _StageCall, with its class) as the user
        names the module; the call itself is the model's own forward around its
        modules."""
        if where is None:
            return None
        if not where.startswith(_PREFIX):
            return f"{self.model_class}.forward (the model's own code around its modules)"
        return where.removeprefix(_PREFIX)

    def _refusal(self, verdict: Verdict) -> str:
        line = pipeline_refusal_line(verdict, self.plan, self.parts)
        return f"{line}; the weights are as they were"


_PREFIX = "model."  # _StageCall's name for the user's model


class _StageCall(nn.Module):
    """A stage module called on one recorded (args, kwargs), as the probe calls a model
    on its inputs. It registers this rank's part of the user's model, not the stage
    module: the stage registers only the modules that hold parameters, and the probe
    holds still, and names, every buffer and module the stage runs (a codebook's
    buffers in a module without parameters: before, the probe's passes each updated
    it, and read that as samples mixing), by the user's names."""

    def __init__(self, stage: nn.Module, user_model: nn.Module) -> None:
        super().__init__()
        self.model = user_model
        object.__setattr__(self, "_stage", stage)  # not registered: see above

    def forward(self, call: tuple[tuple, dict]) -> Any:
        args, kwargs = call
        return self._stage(*args, **kwargs)
