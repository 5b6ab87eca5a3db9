"""BatchCoupling: what couples the samples of one engine's batch, and the scope every
micro-batch's forward and loss run in.

The Engine owns one. Each runner enters `running(rows)` around a micro-batch's forward
and loss; the Engine runs `check_first_batch` at the first training step of a plan that
splits the batch, and sets the load-balancing scale of each step (`count_step`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling import own_loss
from meshfit.coupling.moe import LoadBalancing, find_load_balancing, pipeline_refusal
from meshfit.coupling.probe import Verdict, probe
from meshfit.coupling.products import InBatchProducts
from meshfit.coupling.scope import Scope, active
from meshfit.coupling.statistics import (
    LIBRARIES,
    Statistics,
    batch_statistics,
    in_training,
    note_line,
    parts_named,
    refusal_line,
    splitting_refused,
)
from meshfit.errors import MeshfitError
from meshfit.losses import split_loss
from meshfit.trees import batch_rows, call_model, tensors_in

if TYPE_CHECKING:
    from meshfit.losses import ModelOwnLoss
    from meshfit.topology import Topology


class BatchCoupling:
    """The couplings of one engine: the load-balancing losses found in the model's
    library (always made global), the in-batch products the probe found (gathered from
    then on), and the one scope object the steps reuse (a compiled forward then sees the
    same object every step)."""

    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        model_loss: ModelOwnLoss | None,
        own_statistics: bool = False,
    ) -> None:
        self.topology = topology
        # sync_batchnorm=False: each rank keeps its own batch statistics (statistics.py)
        self.own_statistics = own_statistics
        self.statistics = Statistics()
        self.load_balancing = find_load_balancing(model)
        self.model_loss = model_loss
        self.scope = Scope(
            groups=list(topology.batch_groups),
            sum_groups=list(topology.loss_groups),
            pipeline=topology.plan.pp > 1,
        )
        self.verdict: Verdict | None = None
        # a Hugging Face model's loss_function, gathered over the batch where the probe
        # finds its own loss coupled there (coupling/own_loss.py)
        self.loss_owner = own_loss.loss_owner(model) if model_loss is not None else None
        # the library whose code computes the loss (loss_fn="model" on its model): the
        # refusal's fix cannot be an edit of that code
        tops = (cls.__module__.split(".")[0] for cls in type(model).__mro__)
        library = next((top for top in tops if top in LIBRARIES), None)
        self._library = library if model_loss is not None else None
        config = getattr(model, "config", None)
        self._router_logits_on = bool(getattr(config, "output_router_logits", False))
        self.refuse_under_pipeline(None)

    def balancing_left_out(self) -> Any:
        """A context in which the load-balancing loss counts as zero (context parallel's
        probe compares the rest: coupling/moe.py), or None where the model has none."""
        return self.load_balancing.left_out() if self.load_balancing.found else None

    def refuse_under_pipeline(self, inputs: Any) -> None:
        """A load-balancing loss that is on (the model's config, or the batch's
        output_router_logits) cannot be formed by a pipeline stage: refused on every rank
        alike, before any stage runs (coupling/moe.py)."""
        if not (self.scope.pipeline and self.load_balancing.found):
            return
        asked = isinstance(inputs, dict) and inputs.get("output_router_logits")
        if self._router_logits_on or asked:
            where = self.load_balancing.modules[0].__name__
            raise MeshfitError(pipeline_refusal(where))

    @property
    def splits_batch(self) -> bool:
        """Whether the plan runs the global batch in parts (ranks or micro-batches)."""
        return self.topology.batch_parts > 1

    @contextlib.contextmanager
    def running(self, rows: int) -> Iterator[Scope]:
        """The scope of one micro-batch's forward and loss (`rows` samples on this rank)."""
        scope = self.scope
        scope.rows = rows
        with contextlib.ExitStack() as stack:
            stack.enter_context(active(scope))
            if self.load_balancing.found:
                stack.enter_context(self.load_balancing.global_in_steps())
            if scope.products:
                stack.enter_context(InBatchProducts(scope))
            yield scope

    def count_step(self, inputs: Any, targets: Any, microbatches: int) -> None:
        """Before a step or evaluation: the load-balancing scale for a model's own (sum,
        count) token loss, global count / (loss ranks x micro-batches): every rank adds
        it to its sum (coupling/moe.py)."""
        if not self.load_balancing.found:
            return
        self.refuse_under_pipeline(inputs)
        if self.model_loss is None:
            return
        if not self.model_loss.sums:
            return
        # the share's whole sequences: summed over the ranks that split the batch only
        # (context parallel's ranks hold the same samples, cut later)
        total = self.model_loss.count(targets).to(torch.float64).reshape(1)
        for group in self.topology.batch_groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        self.scope.aux_scale = total[0] / (self.topology.grad_average_size * microbatches)

    def check_first_batch(
        self,
        model: nn.Module,
        run_loss: Any,
        inputs: Any,
        targets: Any,
        low_precision: bool,
        *,
        statistics: bool = True,
    ) -> None:
        """The coupling probe on this rank's first samples (a plan that splits the batch
        only): a loss that couples samples where meshfit makes it global trains on; one
        whose coupling the in-batch products explain has them gathered from now on; any
        other is refused in one line. `statistics`: then the statistics question (at a
        training step: an evaluation's forward updates no buffer)."""
        if not self.splits_batch:
            return
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        verdict = probe(
            model,
            run_loss,
            self._probe_scope,
            inputs,
            targets,
            low_precision=low_precision,
            world=world,
            owner=self.loss_owner,
        )
        self.verdict = verdict
        if verdict is not None and verdict.coupled:
            raise MeshfitError(self._refusal(verdict))
        if verdict is not None:
            self.scope.products = verdict.products
            if verdict.own_loss and self.loss_owner is not None:
                own_loss.install(self.loss_owner)
                self.scope.own_loss = verdict.own_loss
        if not statistics:
            return
        # mf.gather_batch crosses ranks, not micro-batches (run one after another)
        gathered = self.topology.plan.num_microbatches == 1
        self.statistics = batch_statistics(
            model,
            run_loss,
            self._probe_scope,
            inputs,
            targets,
            low_precision=low_precision,
            world=world,
            gathered=gathered,
        )
        if self.statistics.read and not self.own_statistics:
            parts = self._parts()
            plan = self.topology.plan
            raise MeshfitError(refusal_line(self.statistics, model, plan, parts, gathered))

    def _probe_scope(self, **kwargs: Any) -> contextlib.AbstractContextManager[Scope]:
        """A scope local to this rank (no groups): the probe's halves stand for ranks."""
        return probe_scope(self.load_balancing, self.model_loss, **kwargs)

    def note(self) -> str | None:
        """A start-up line on what was made global (None: nothing coupled)."""
        verdict = self.verdict
        if verdict is not None and verdict.summed:
            return (
                "the loss is a sum over the samples (reduction='sum': its parts add up to "
                "it); meshfit adds up the ranks' and micro-batches' sums, as one process "
                "sums the whole batch"
            )
        if verdict is None or not verdict.met:
            return None
        plan = self.topology.plan
        how = ", ".join(sorted(verdict.met))
        line = f"the loss couples the samples of a batch ({how})"
        ranks, micro = self.topology.dp_size, plan.num_microbatches
        if ranks > 1:
            line += f"; meshfit forms it over the {ranks} data-parallel ranks' samples together"
        if micro > 1:
            rounds = "the m-th of every rank together" if ranks > 1 else "one at a time"
            line += (
                f"; with {micro} micro-batches it is formed per micro-batch ({rounds}) and "
                f"averaged, as one process with microbatches={micro} computes it"
            )
        return line

    def notes(self) -> list[str]:
        """The start-up lines of the first step's probe: what was made global, buffers
        updated from each part's share, random draws made per part."""
        lines = (self.note(), self.statistics_note(), self.draws_note())
        return [line for line in lines if line]

    def draws_note(self) -> str | None:
        """A start-up line on random numbers the training forward draws besides
        dropout's (None: none, or the probe did not run)."""
        draws = self.verdict.draws if self.verdict is not None else ()
        if not draws:
            return None
        sites = "; ".join(draws[:2]) + ("; ..." if draws[2:] else "")
        return (
            f"the model draws random numbers in its training forward ({sites}): plan "
            f"{self.topology.plan} splits the batch over {self._parts()}, each "
            f"drawing its own, so this run matches one process's in distribution, not "
            f"number for number (as with dropout)"
        )

    def statistics_note(self) -> str | None:
        """A start-up line on buffers updated from each part's share (None: none)."""
        return note_line(self.statistics, self.topology.plan, self._parts())

    def _parts(self) -> str:
        """What the plan splits the batch over: `2 data-parallel ranks x 2 micro-batches`."""
        return parts_named(self.topology.dp_size, self.topology.plan.num_microbatches)

    def _refusal(self, verdict: Verdict) -> str:
        plan = self.topology.plan
        parts = self._parts()
        where = f"; {mixing_named(verdict)}"
        if not verdict.where and getattr(self.model_loss, "scaled", False):
            where += (
                " (loss_fn='model' takes the model's own masked-LM loss for a mean over its "
                "labels that are not -100 and adds up each rank's mean times its count, and "
                "this loss is not such a mean: pass a loss_fn over its logits, e.g. "
                "mf.losses.cross_entropy())"
            )
        together, apart = distinct(verdict.together, verdict.apart)
        return (
            f"the loss couples the samples of a batch and meshfit cannot make it global: on "
            f"{verdict.samples} samples of the first batch it is {together} "
            f"together but {apart} as plan {plan} combines its halves "
            f"(relative difference {verdict.difference:.1e}){where}. Plan {plan} splits the "
            f"batch over {parts}, so it would train another run than one process. " + self._fix()
        )

    def _fix(self) -> str:
        whole = "a plan that keeps the batch whole (tp=N, or pp=N with microbatches=1)"
        if self._library is not None:  # loss_fn="model": the library's code, not the user's
            owner = self._library + ("'" if self._library.endswith("s") else "'s")
            return (
                f"It is {owner} code (loss_fn='model'), which meshfit does not "
                f"change: use {whole}, or a configuration of the model that keeps its "
                f"samples apart"
            )
        return (
            "Gather what couples with mf.gather_batch(x) (the global batch's rows, gradients "
            f"flowing back) or sum it with mf.batch_sum(x), or use {whole}"
        )


@contextlib.contextmanager
def probe_scope(
    load_balancing: LoadBalancing,
    model_loss: ModelOwnLoss | None,
    *,
    replay: Any,
    rows: int,
    parts: int,
    targets: Any,
    products: bool,
    own_loss: dict | None = None,
) -> Iterator[Scope]:
    """The scope of one probe pass, local to this process (no groups): the probe's
    halves stand for ranks, a load-balancing loss is formed over each pass's samples."""
    scale: torch.Tensor | float = 1.0
    if load_balancing.found and model_loss is not None and model_loss.sums:
        scale = model_loss.count(targets).to(torch.float64) / parts
    scope = Scope(rows=rows, aux_scale=scale, products=products, replay=replay, own_loss=own_loss)
    with contextlib.ExitStack() as stack:
        stack.enter_context(active(scope))
        if load_balancing.found:
            stack.enter_context(load_balancing.global_in_steps())
        if products:
            stack.enter_context(InBatchProducts(scope))
        yield scope


def planned_refusal(
    model: nn.Module, inputs: Any, loss_fn: Any = None, targets: Any = None
) -> str | None:
    """The planner's reason to drop every plan that splits the batch (ranks or
    micro-batches), asked of one process before anything is built, as the first step
    asks it: a loss that couples the samples where meshfit cannot make it global (asked
    for a `loss_fn` you pass, with targets; the model's own loss is asked at the first
    step), then a statistic of the batch kept in a buffer the forward reads
    (statistics.py). None: neither, or nothing to ask on (fewer than two samples)."""
    if callable(loss_fn) and targets is not None:
        verdict = probed_whole(model, _loss_of(model, loss_fn), inputs, targets, None)
        if verdict is not None and verdict.coupled:
            return (
                f"the loss couples the samples of a batch and meshfit cannot make it global "
                f"({mixing_named(verdict)}): a plan that splits the batch (ranks or micro-batches) "
                f"would train another run (mf.gather_batch(x) in the loss would make it "
                f"global)"
            )
    return splitting_refused(model, inputs)


def pipeline_coupling_refusal(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Any | None,
    *,
    plan: Any,
    parts: str,
    low_precision: bool,
    world: dist.ProcessGroup | None,
) -> tuple[str | None, Verdict | None]:
    """Pipeline parallel's coupling question, asked on the whole model before its cut
    (the probe cannot run under a pipeline schedule, whose stages run whole micro-batches:
    before, a module that mixed the samples, or a loss of the batch's worst sample,
    trained each micro-batch on its own with no word): on `inputs` (the first
    micro-batch, or the first batch's first four samples where it holds fewer:
    runtime/examples.to_build_on) with the loss where it can run here (`loss_fn`, the user's, given the
    targets; None for the model's own loss: for that, or a build before any batch, the
    forward alone, each sample's output standing for its loss: `per_sample_output`). The
    one line refusing a coupling meshfit cannot make global (in-batch products are
    gathered under pp too), or None; compose raises it once the cut's own checks have
    passed (their refusals name the model's structure, the first thing to fix). And the
    verdict on the user's loss, where it was asked (None for the forward alone): a sum
    or a mean over the real targets found here, with the model run on each half, is
    trained so (losses.SampleSum.take_before_the_cut), where the last stage's question
    of the loss alone cannot tell (a loss that reads the model's own `outputs.loss`)."""
    of_a_loss = loss_fn is not None and targets is not None
    if of_a_loss:
        run_loss = _loss_of(model, loss_fn)
    else:
        run_loss, targets = per_sample_output(model), inputs
    verdict = probed_whole(model, run_loss, inputs, targets, world, low_precision)
    of_the_loss = verdict if of_a_loss else None
    if verdict is None or not verdict.coupled:
        return None, of_the_loss
    return pipeline_refusal_line(verdict, plan, parts), of_the_loss


def pipeline_refusal_line(verdict: Verdict, plan: Any, parts: str) -> str:
    """The one line refusing a coupling pp found on its first micro-batch, before the
    cut (above) or at the first pass (stages.py)."""
    together, apart = distinct(verdict.together, verdict.apart)
    return (
        f"the loss couples the samples of a batch and meshfit cannot make it global: on "
        f"{verdict.samples} samples of the first batch it is {together} together but "
        f"{apart} as their halves combine (relative difference {verdict.difference:.1e}); "
        f"{mixing_named(verdict)}. Plan {plan} splits the batch over {parts}, so it would train "
        f"another run than one process. Use a plan that keeps the batch whole "
        f"(pp=N,microbatches=1,schedule=gpipe, or tp=N)"
    )


def _loss_of(model: nn.Module, loss_fn: Any) -> Any:
    def run_loss(x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return split_loss(loss_fn(call_model(model, x), y))

    return run_loss


def probed_whole(
    model: nn.Module,
    run_loss: Any,
    inputs: Any,
    targets: Any,
    world: dist.ProcessGroup | None,
    low_precision: bool | None = None,
) -> Verdict | None:
    """The probe on the whole model in this process, in training mode whatever the
    model's (from_pretrained returns it in evaluation mode), as a training step runs it.
    None where it cannot run (every rank holds the same batch and fails alike; the
    first step or the cut's check forward says what failed)."""
    if low_precision is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        low_precision = dtype in (torch.bfloat16, torch.float16)
    scope = functools.partial(probe_scope, find_load_balancing(model), None)
    try:
        with in_training(model):
            return probe(
                model, run_loss, scope, inputs, targets, low_precision=low_precision, world=world
            )
    except Exception:  # noqa: BLE001 - see above
        return None


def mixing_named(verdict: Verdict) -> str:
    """Where the probe found the samples mixing, as a refusal says it."""
    if verdict.where:
        return (
            f"the first module whose output for a sample depends on the others is {verdict.where}"
        )
    return "every module's output is per sample, so the loss function mixes them"


def per_sample_output(model: nn.Module) -> Any:
    """A probe pass without a loss: the mean over the samples of each sample's output
    squared under fixed positive random weights (the first floating output holding one
    row per sample on the first pass, over all the samples, and the same output on the
    halves': a pipeline's last stage also returns the model's own loss as one row,
    which a pass over one sample took for the sample's output): a mean of per-sample
    losses wherever the forward keeps the samples apart, so the probe's halves combine
    to it; squares, so no cancellation amplifies rounding; in the output's dtype, so the
    probe judges it by that dtype's rounding."""

    chosen: list[int] = []  # the output's place, found on the first pass (all samples)

    def run(inputs: Any, _targets: Any) -> tuple[torch.Tensor, None]:
        rows = batch_rows(inputs)
        outputs = tensors_in(call_model(model, inputs))
        if not chosen:
            per_sample = (
                i
                for i, t in enumerate(outputs)
                if t.is_floating_point() and t.ndim >= 1 and t.shape[0] == rows
            )
            chosen.append(next(per_sample, -1))
        out = outputs[chosen[0]] if 0 <= chosen[0] < len(outputs) else None
        if out is None or out.shape[0] != rows:  # nothing per sample to compare
            return torch.zeros((), dtype=torch.float64), None
        dtype, out = out.dtype, out.detach().double()
        weights = torch.rand(out.shape[1:], generator=torch.Generator().manual_seed(0),
                             dtype=torch.float64) + 0.5  # fmt: skip
        per_sample = (out.square() * weights.to(out.device)).reshape(rows, -1).sum(1)
        return per_sample.mean().to(dtype), None

    return run


def distinct(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` with 6 significant digits, or as many more as it takes to show them
    apart (a difference below the 6th digit printed two equal numbers)."""
    for digits in range(6, 18):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1] or a == b:
            return shown
    return repr(a), repr(b)
