"""The coupling probe: does this loss couple the samples of a batch? Asked at the first
training step of a plan that splits the batch, before anything is trained.

A loss is safe to split when the loss of some samples together equals the plan's
combination of the losses of their parts (the mean of equal parts' means, or the sums
over the counts of a (sum, count) pair). The probe takes the first samples of this
rank's share (four, or two), computes the loss of them together and of their two
halves apart, without gradients and with every source of randomness held still
(dropout off, the random state restored), BatchNorm in evaluation mode (meshfit makes
BatchNorm global itself: parallel/batchnorm.py) and every buffer restored, and
compares.

What meshfit already makes global (scope.py: `mf.gather_batch`, `mf.batch_sum`, the
load-balancing loss of coupling/moe.py, the in-batch products of coupling/products.py)
is simulated: the pass over the samples together records what those points see, and
each half's pass is given the other half's part of it, as the other rank would send it.
So a loss whose only couplings meshfit makes global passes, and one with another
coupling does not: the probe then tries gathering in-batch products, and if that does
not make it pass either, it finds the first module whose output for a sample depends on
the other samples, and meshfit refuses the plan, naming it.

The verdict is agreed over every rank (the largest difference wins), so all ranks take
the same path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.coupling import halves, own_loss
from meshfit.coupling.buffers import SavedBuffers
from meshfit.coupling.draws import HeldDraws
from meshfit.trees import batch_rows, slice_rows, tensors_in

LossPair = tuple[torch.Tensor, "torch.Tensor | None"]


class Inconclusive(Exception):  # noqa: N818 - a verdict, not an error
    """The halves did not run the same way as the whole (another number of coupling
    points, other shapes): the probe cannot tell."""


@dataclass
class Verdict:
    """The probe's answer: `coupled` (the relative difference beyond rounding),
    `products` (gathering in-batch products made it pass), the numbers it compared, and
    `where` (the first module whose output mixes samples) when it stays coupled."""

    samples: int
    together: float
    apart: float
    difference: float
    coupled: bool
    products: bool = False
    summed: bool = False  # a sum over the samples: the halves add up to the whole
    # a plain mean of the samples although their targets hold unequal numbers of -100
    # entries (CTC's mean over each transcript): no token weighting to warn of
    per_sample: bool = False
    # a mean over the targets that are not -100 (F.cross_entropy(ignore_index=-100)): the
    # halves combined by their counts of real targets give the whole, their plain mean
    # does not. Trained as (mean x count, count) pairs (losses.SampleSum): exact
    token_mean: bool = False
    # that mean counted over each row's targets after its first: a loss that shifts the
    # labels itself (logits[:, :-1] against labels[:, 1:])
    shifted: bool = False
    # and counted over the targets that are not this (the padding's own value, where a
    # script pads its labels with the pad id and ignores that)
    ignored: int = -100
    met: frozenset[str] = frozenset()
    where: str | None = None
    # the model's own loss function gathered over the batch (coupling/own_loss.py):
    # each argument's sample dimension
    own_loss: dict | None = None
    # where the training forward draws random numbers other than dropout's (PhiMoE's
    # router): each rank draws its own, as with dropout (said at start-up)
    draws: tuple[str, ...] = ()


class Replay:
    """The points where samples meet, recorded over the samples together and replayed into
    each half's pass: a gathered tensor gets the other half's rows from the record, a
    summed statistic is the record's total."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.calls: list[torch.Tensor] = []
        self.recording = True
        self.index = 0
        self.start = self.stop = 0

    def half(self, start: int, stop: int) -> None:
        self.recording, self.index, self.start, self.stop = False, 0, start, stop

    def _recorded(self, x: torch.Tensor) -> torch.Tensor:
        if self.index >= len(self.calls):
            raise Inconclusive("a half met more coupling points than the whole")
        recorded = self.calls[self.index]
        self.index += 1
        return recorded

    def rows(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.recording:
            self.calls.append(x.detach())
            return x
        recorded = self._recorded(x)
        dim = dim % x.ndim
        live = self.stop - self.start
        per_sample, rest = divmod(x.shape[dim], live)
        expected = list(x.shape)
        expected[dim] = per_sample * self.samples
        if rest or list(recorded.shape) != expected:
            raise Inconclusive("a gathered tensor's rows do not follow the samples")
        whole = recorded.clone()
        whole.narrow(dim, self.start * per_sample, live * per_sample).copy_(x)
        return whole

    def items(self, items: list) -> list:
        if self.recording:
            self.calls.append(list(items))
            return items
        recorded = self._recorded(items)
        if not isinstance(recorded, list) or len(recorded) != self.samples:
            raise Inconclusive("a gathered list's items do not follow the samples")
        return [*recorded[: self.start], *items, *recorded[self.stop :]]

    def total(self, x: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self.calls.append(x.detach())
            return x
        recorded = self._recorded(x)
        if recorded.shape != x.shape:
            raise Inconclusive("a summed statistic changed shape")
        return recorded


# what a probe pass runs: the loss of these samples, with the coupling points of the
# scope that `open_scope(replay, samples, parts, products)` makes
RunLoss = Callable[[Any, Any], LossPair]
OpenScope = Callable[..., contextlib.AbstractContextManager]


def probe(
    model: nn.Module,
    run_loss: RunLoss,
    open_scope: OpenScope,
    inputs: Any,
    targets: Any,
    *,
    low_precision: bool,
    world: dist.ProcessGroup | None,
    owner: nn.Module | None = None,
) -> Verdict | None:
    """Whether the loss couples the samples of a batch (None: fewer than two samples in
    this rank's share, or a batch the halves could not run alike: nothing to tell).
    `owner`: the module whose `loss_function` computes the model's own loss, tried
    gathered over the batch where nothing else explains the coupling."""
    samples = probe_samples(inputs)
    if samples == 0:
        return None
    x = slice_rows(inputs, 0, samples)
    y = slice_rows(targets, 0, samples)
    draws: list[str] = []
    verdict = _compare(
        model, run_loss, open_scope, x, y, samples, False, low_precision, world, draws=draws
    )
    if verdict is None or not verdict.coupled:
        if verdict is not None:
            verdict.draws = tuple(draws)
        return verdict
    with_products = _compare(model, run_loss, open_scope, x, y, samples, True, low_precision, world)
    if with_products is not None and not with_products.coupled and with_products.met:
        with_products.products = True
        return with_products
    verdict.where = _first_mixing_module(model, run_loss, open_scope, x, y, samples, world)
    if owner is None:
        return verdict
    dims = _own_loss_dims(owner, run_loss, open_scope, x, y, samples)
    if not _everywhere(verdict.where is None and dims is not None, world):
        return verdict
    with own_loss.wrapped(owner, own_loss.GatheredLoss):
        gathered = _compare(
            model, run_loss, open_scope, x, y, samples, False, low_precision, world, dims
        )
    if gathered is not None and not gathered.coupled:
        gathered.own_loss = dims
        return gathered
    return verdict


def probe_samples(inputs: Any) -> int:
    """How many of this rank's first samples a probe compares: four, or two (0: fewer
    than two, nothing to compare)."""
    n = batch_rows(inputs)
    return 4 if n >= 4 else 2 if n >= 2 else 0


def _everywhere(flag: bool, world: dist.ProcessGroup | None) -> bool:
    """Whether `flag` holds on every rank (each rank then takes the same path)."""
    agreed = torch.tensor([float(flag)])
    if world is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=world)
    return bool(agreed[0] > 0)


def _own_loss_dims(
    owner: nn.Module, run_loss: RunLoss, open_scope: OpenScope, x: Any, y: Any, samples: int
) -> dict | None:
    """How each argument of the model's one call of its loss function holds the samples
    (own_loss.sample_dims), from a pass over the samples and one over half of them."""
    half = samples // 2
    layouts = []
    try:
        with held_still(owner) as buffers, own_loss.wrapped(owner, own_loss.Recorder) as recorder:
            drawn = torch.get_rng_state()
            for rows in (samples, half):
                torch.set_rng_state(drawn)
                buffers.restore()
                with open_scope(replay=None, rows=rows, parts=1, targets=y, products=False):
                    run_loss(slice_rows(x, 0, rows), slice_rows(y, 0, rows))
                layouts.append(list(recorder.calls))
                recorder.calls.clear()
    except Exception:  # noqa: BLE001 - no layout: the refusal stands
        return None
    if any(len(calls) != 1 for calls in layouts):
        return None
    return own_loss.sample_dims(layouts[0][0], layouts[1][0], samples)


def _compare(
    model: nn.Module,
    run_loss: RunLoss,
    open_scope: OpenScope,
    x: Any,
    y: Any,
    samples: int,
    products: bool,
    low_precision: bool,
    world: dist.ProcessGroup | None,
    own: dict | None = None,
    draws: list[str] | None = None,
) -> Verdict | None:
    half = samples // 2
    replay = Replay(samples)
    met: set[str] = set()
    failed = torch.zeros(1, dtype=torch.float64)
    try:
        with held_still(model, draws) as buffers:
            # each pass draws the same random numbers (LayerDrop's skips: wav2vec2's
            # config skips each layer with p=0.1 in training, by `torch.rand([])`) and
            # starts from the same buffers, as each rank would (coupling/statistics.py
            # asks about buffers updated from the batch)
            drawn = torch.get_rng_state()
            with open_scope(
                replay=replay, rows=samples, parts=1, targets=y, products=products, own_loss=own
            ) as s:
                together = run_loss(x, y)
                met |= s.met
            parts = []
            for start, stop in ((0, half), (half, samples)):
                torch.set_rng_state(drawn)
                buffers.restore()
                replay.half(start, stop)
                piece = (slice_rows(x, start, stop), slice_rows(y, start, stop))
                with open_scope(
                    replay=replay,
                    rows=stop - start,
                    parts=2,
                    targets=y,
                    products=products,
                    own_loss=own,
                ) as s:
                    parts.append(run_loss(*piece))
                    met |= s.met
    except Inconclusive:
        failed[0] = 1
        together, parts = (torch.zeros(()), None), []
    except Exception:
        if own is None:
            raise
        # the model's own loss over what meshfit gathered failed inside the library's
        # code (RT-DETR's denoising matcher indexes its per-image queries): gathering
        # does not explain the coupling, and the refusal says what does; this is not
        # the user's batch (which the passes before ran) to blame
        failed[0] = 1
        together, parts = (torch.zeros(()), None), []
    difference, value_together, value_apart = _difference(together, parts)
    off = _mean_distances(together, parts, y, half)
    verdict = torch.cat([torch.tensor([difference, float(failed[0])], dtype=torch.float64), off])
    if world is not None:  # agreed: every rank takes the same path
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=world)
    if verdict[1] > 0:
        return None
    if together[1] is None and parts:
        # a mean over targets with ignored (-100) entries: the halves weigh their real
        # targets by their own counts. That the plan combines them unequally is a known
        # difference, warned of at the first step (batch_errors.warn_on_ignored_targets),
        # not a coupling: the combination weighted by the real targets is what counts,
        # one way of counting them for every rank (without ignored targets it is the
        # plain mean, the difference as it stands)
        verdict[0] = min(float(verdict[0]), halves.explained(verdict[2:]))
    dtype = together[0].dtype
    limit = halves.rounding(dtype, low_precision)
    # a sum over the samples (reduction="sum") is no coupling: SampleSum trains it
    found = halves.kind(verdict[2:], limit, halves.noise(dtype, low_precision))
    return Verdict(
        samples=samples,
        together=value_together,
        apart=value_apart,
        difference=float(verdict[0]),
        coupled=bool(verdict[0] > limit) and not found.summed,
        met=frozenset(met),
        summed=found.summed,
        per_sample=found.per_sample,
        token_mean=found.counted,
        shifted=found.shifted,
        ignored=found.ignored,
    )


def _mean_distances(
    together: LossPair, parts: list[LossPair], targets: Any, half: int
) -> torch.Tensor:
    """halves.distances for a loss returned as a mean (no count); a pair, or no halves,
    is neither a sum nor a mean over the real targets."""
    if not parts or together[1] is not None:
        return torch.tensor(halves.NEITHER, dtype=torch.float64)
    (loss, _), [(a, _), (b, _)] = together, parts
    whole, a, b = (float(v.double()) for v in (loss, a, b))
    return halves.distances(whole, a, b, half, 2 * half, targets)


def _difference(together: LossPair, parts: list[LossPair]) -> tuple[float, float, float]:
    """(relative difference, loss together, the plan's combination of the halves')."""
    if not parts:
        return 0.0, 0.0, 0.0
    (loss, count), [(a, count_a), (b, count_b)] = together, parts
    if count is None:  # means: the plan averages equal parts' means
        whole = loss.double()
        apart = (a.double() + b.double()) / 2
    else:  # (sum, count): sums over counts
        whole = loss.double() / count.double().clamp_min(1)
        apart = (a.double() + b.double()) / (count_a + count_b).double().clamp_min(1)
    scale = max(abs(float(whole)), 1e-12)
    return abs(float(apart - whole)) / scale, float(whole), float(apart)


@contextlib.contextmanager
def held_still(model: nn.Module, draws: list[str] | None = None) -> Iterator[SavedBuffers]:
    """No gradients, no dropout, the random state and every buffer as they were after,
    BatchNorm normalising with its running statistics (no batch statistics: meshfit
    makes those global by itself). Yields the saved buffers (a pass that must start
    from them restores them first); `draws` gets where the forward drew (draws.HeldDraws)."""
    norms = [
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    # by name: a forward may replace a buffer rather than write into it (I-BERT's)
    buffers = SavedBuffers(model)
    frozen = [(p, p._version) for p in model.parameters() if not p.requires_grad]
    # drop-path modules that draw with torch.rand (transformers' SwinDropPath,
    # ConvNextDropPath, ...: `keep + torch.rand(shape)`, floored) rather than bernoulli_:
    # their drop_prob held at 0 (a draw over another number of samples read as a coupling,
    # naming Swin's drop_path)
    dropping = [
        (m, m.drop_prob)
        for m in model.modules()
        if isinstance(getattr(m, "drop_prob", None), float) and m.drop_prob > 0
    ]
    for m in norms:
        m.eval()
    for m, _ in dropping:
        m.drop_prob = 0.0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), HeldDraws(draws):
            yield buffers
    finally:
        for m in norms:
            m.train()
        for m, p in dropping:
            m.drop_prob = p
        buffers.restore()
    changed = [p for p, version in frozen if p._version != version]
    if changed:
        from meshfit.errors import MeshfitError

        raise MeshfitError(
            "meshfit's coupling probe ran the model's forward without training and the "
            "forward changed a frozen parameter in place, which the probe cannot undo; "
            "this is a meshfit limitation: report it, and meanwhile train with a plan "
            "that does not split the batch (tp=N)"
        )


def _first_mixing_module(
    model: nn.Module,
    run_loss: RunLoss,
    open_scope: OpenScope,
    x: Any,
    y: Any,
    samples: int,
    world: dist.ProcessGroup | None,
) -> str | None:
    """The first module, in the order the forward calls them, whose output for the first
    half's samples differs between the pass over all samples and the pass over the half
    alone: where the samples start to mix (None: every module agrees, so the loss
    function itself mixes them)."""
    half = samples // 2
    names = {id(m): name for name, m in model.named_modules()}
    seen: dict[str, list[tuple]] = {}
    order: list[str] = []
    first: list[str | None] = [None]

    def hook(module: nn.Module, _args: Any, output: Any) -> None:
        name = names.get(id(module), "")
        found = [t for t in tensors_in(output) if t.is_floating_point() and t.ndim >= 1]
        if not found:
            return
        calls = seen.setdefault(name, [])
        if recording[0]:
            order.append(name)
            calls.append(_fingerprint(found[0].detach()[:half], len(calls)))
            return
        index = replayed.setdefault(name, 0)
        replayed[name] = index + 1
        if index >= len(calls) or first[0] is not None:
            return
        whole, part = calls[index], _fingerprint(found[0].detach(), index)
        if whole[0] != part[0]:
            return
        if abs(whole[1] - part[1]) / max(whole[2], 1e-30) > 1e-6:
            first[0] = name

    recording = [True]
    replayed: dict[str, int] = {}
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with held_still(model) as buffers:
            drawn = torch.get_rng_state()  # both passes draw alike (as in _compare)
            with open_scope(
                replay=Replay(samples), rows=samples, parts=1, targets=y, products=False
            ):
                run_loss(x, y)
            recording[0] = False
            torch.set_rng_state(drawn)
            buffers.restore()
            with open_scope(replay=None, rows=half, parts=1, targets=y, products=False):
                run_loss(slice_rows(x, 0, half), slice_rows(y, 0, half))
    except Exception:  # noqa: BLE001 - only a name for the refusal; it stands without one
        return None
    finally:
        for handle in handles:
            handle.remove()
    where = first[0]
    if where == "":
        return f"{type(model).__name__}.forward (the model's own code around its modules)"
    if where is None:
        return None
    module = model.get_submodule(where)
    return f"{where} ({type(module).__name__})"


def _fingerprint(t: torch.Tensor, index: int) -> tuple[tuple[int, ...], float, float]:
    """(shape, a random projection, norm) of a module's output for the first half's
    samples, taken when the output is made: the output itself may be written in place
    later in the forward (wav2vec2's encoder zeroes the padded frames of the projection's
    output), and a view kept until the comparison then blamed a module that mixes
    nothing. The projection differs by about the norm of the difference (a Gaussian
    direction), seeded alike for the whole's and the half's call."""
    flat = t.reshape(-1).double()
    g = torch.Generator().manual_seed(1234 + index)
    direction = torch.randn(flat.numel(), generator=g, dtype=torch.float64).to(flat.device)
    return tuple(t.shape), float(flat @ direction), float(flat.norm())
