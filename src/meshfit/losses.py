"""Losses that meshfit normalises exactly however the batch is split.

A `loss_fn` may return a pair `(loss_sum, count)`: the loss summed over the items it
covers (tokens, say) and how many there are. meshfit then trains on the sum over the
global batch divided by the count over the global batch, whatever the plan: every token
weighs the same as in one process, also when ranks and micro-batches hold different
numbers of real (unmasked) tokens. A plain mean per micro-batch cannot do that: averaging
per-micro-batch means weighs a token of a short micro-batch more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from meshfit.coupling import halves
from meshfit.trees import batch_rows, map_tensors, slice_rows, tensors_in

if TYPE_CHECKING:
    from meshfit.topology import Topology

LossPair = tuple[torch.Tensor, torch.Tensor]

# Inside a context-parallel step the targets were shifted before the sequence was cut
# (parallel/context/): the losses here that would shift them skip it.
_PRESHIFTED = [False]


@contextlib.contextmanager
def targets_preshifted() -> Iterator[None]:
    _PRESHIFTED.append(True)
    try:
        yield
    finally:
        _PRESHIFTED.pop()


def _preshifted() -> bool:
    return _PRESHIFTED[-1]


def cross_entropy(ignore_index: int = -100, shift: bool = False) -> CrossEntropy:
    """Token cross-entropy as `(sum over real tokens, number of real tokens)`.

    Takes logits `[..., vocab]` (a tensor, or a model output object with `.logits`,
    e.g. a Hugging Face `CausalLMOutput`) and integer targets of the same leading shape;
    targets equal to `ignore_index` (padding, masked prompts) count for nothing.
    shift=True predicts token t+1 from position t (labels as Hugging Face collators give
    them, unshifted); leave it False when the targets are already the next tokens.
    """
    return CrossEntropy(ignore_index, shift)


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """`mf.losses.cross_entropy`'s loss: an object, not a closure, so that it pickles
    (mf.verify and mf.launch send the loss to their workers)."""

    ignore_index: int = -100
    shift: bool = False
    deferred_head = "outputs"  # chunked_loss=True applies (parallel/head_loss.py)

    @property
    def shifts_targets(self) -> bool:  # context parallel reads it
        return self.shift

    def __call__(self, outputs: Any, targets: torch.Tensor) -> LossPair:
        from meshfit.parallel.head_loss import take_deferred

        ignore_index = self.ignore_index
        logits = logits_of(outputs)
        deferred = take_deferred(logits)  # chunked_loss=True: the head's input instead
        if deferred is not None:
            shifts = self.shift and not _preshifted()
            targets = targets[..., 1:] if shifts else targets
            total = deferred.loss(targets, ignore_index, shift=shifts)
            return total, (targets != ignore_index).sum()
        if self.shift and not _preshifted():
            logits, targets = logits[..., :-1, :], targets[..., 1:]
        logits = logits.reshape(-1, logits.shape[-1])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        targets = targets.reshape(-1)
        total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
        return total, (targets != ignore_index).sum()


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's output: itself, `.logits`, or the first element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(f"cannot find logits in a {type(outputs).__name__}")


def split_loss(value: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, count) from what a loss_fn returned: a mean (count None) or a pair."""
    from meshfit.errors import MeshfitError

    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value, None
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in value)
    ):
        return value[0], value[1].to(value[0].device)
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise MeshfitError(
        f"loss_fn must return one number, the mean loss over the batch, or a pair "
        f"(loss_sum, count) of 0-dim tensors, but it returned {shape}; use a mean reduction "
        f"(e.g. reduction='mean') or mf.losses.cross_entropy()"
    )


class ModelOwnLoss:
    """`loss_fn="model"`: train on the loss the model computes from the `labels` in the
    batch (`outputs.loss`, as Hugging Face models do).

    Where the model's loss takes `num_items_in_batch` (Hugging Face's shared loss
    functions do), meshfit calls the model with num_items_in_batch=1, so `outputs.loss`
    is the summed loss, counts the items it sums over (labels that are not -100, shifted
    by one for a causal LM as the model shifts them), and trains on the global sum over
    the global count: the same arithmetic as passing the global count, and the same run
    as one process under any plan. This holds for Hugging Face's causal-LM, masked-LM
    and token-classification losses (the token losses that take the count). A masked-LM
    or token-classification loss the model averages itself (BERT's, RoBERTa's,
    DistilBERT's, ESM's `CrossEntropyLoss()`: a mean over the labels that are not -100)
    is multiplied back by the rank's count into the
    sum it averaged (a rank with none: 0), and trained as such a pair: before, it was a
    mean of the ranks' means, another run under dp (warned) and refused under cp. The
    first step's coupling probe checks the pair adds up over the samples as one
    process's loss does (coupling/probe.py), so a model loss that is not that mean is
    not trained as one. So are a token classifier's, a semantic segmentation's and an
    encoder-decoder's own mean (`_token_loss_kind`). Any other model loss (a sequence
    classifier's) is a mean and is trained as a loss_fn returning a mean is."""

    def __init__(self, model: Any) -> None:
        kind = _token_loss_kind(model)
        self.kind = kind
        self.shifted = kind == "causal"
        self.sums = kind is not None and takes_num_items(model)
        # a mean over the counted labels (a causal LM's own: Clvp's, BLIP's text decoder's;
        # before, each rank's mean was averaged, which the coupling probe refused under dp)
        own_mean = kind in ("masked", "tokens", "pixels") or (
            kind == "causal" and _own_shifted_mean(model)
        )
        self.scaled = own_mean and not self.sums
        config = getattr(model, "config", None)
        # what the loss leaves out: -100, a segmentation's own ignored label
        self.ignore_index = (
            getattr(config, "semantic_loss_ignore_index", 255) if kind == "pixels" else -100
        )
        # a CTC head's loss summed over the samples (wav2vec2, HuBERT, WavLM, ...:
        # ctc_loss_reduction="sum", their configs' default): trained as a sum (SampleSum)
        self.sums_samples = type(model).__name__.endswith("ForCTC") and (
            getattr(config, "ctc_loss_reduction", None) == "sum"
        )

    @property
    def deferred_head(self) -> str | None:
        """For chunked_loss=True (parallel/head_loss.py): the Hugging Face token loss the
        model computes ("causal" or "masked"), which meshfit can take over; None for any
        other model loss."""
        if not self.sums or self.kind in ("tokens", "pixels"):  # a classifier's few labels
            return None
        return "causal" if self.shifted else "masked"

    @property
    def shifts_targets(self) -> bool:
        """Whether the model shifts the labels itself (a causal LM): context parallel
        shifts them before the cut instead (parallel/context/)."""
        return self.shifted

    def model_kwargs(self) -> dict[str, Any]:
        """What meshfit adds to the model's keyword arguments."""
        return {"num_items_in_batch": 1} if self.sums else {}

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """The items the model's summed loss covers in `labels`: those that are not -100
        (a segmentation's: not its ignored label), shifted by one for a causal LM, as the
        model shifts them."""
        counted = labels[..., 1:] if self.shifted and not _preshifted() else labels
        return (counted != self.ignore_index).sum()

    def __call__(self, outputs: Any, labels: torch.Tensor) -> Any:
        loss = getattr(outputs, "loss", None)
        if loss is None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if loss is None:
            from meshfit.errors import MeshfitError

            raise MeshfitError(
                f"loss_fn='model' trains on the model's own loss, but its "
                f"{type(outputs).__name__} output has none; put the labels in the batch "
                f"(batch['labels']) or pass a loss_fn"
            )
        if self.scaled:
            count = self.count(labels)
            # a rank whose labels are all -100 has a NaN mean: its sum is 0 (the gradient
            # through `where` is 0 there, and PyTorch's cross-entropy gives no NaN for it)
            return torch.where(count > 0, loss * count, torch.zeros_like(loss)), count
        if not self.sums:
            return loss
        return loss, self.count(labels)


class SampleSum:
    """The loss_fn the runners call: the user's (or the model's own), passed through,
    until the loss is known to be a sum over the samples rather than a mean (a loss_fn
    with reduction="sum", a CTC head's default loss): from then on each call returns it
    as the pair (loss x G, rows), G the global batch's rows (`global_rows`, set by the
    engine each step), so that the global sum over the global count is the sum over the
    global batch, as one process computes it. Before, such a loss was divided by the
    micro-batch count under pp with no word (a CTC model under pp=2: 106.4 where one
    process has 425.7) and refused as coupled under dp.

    It is known from the model (ModelOwnLoss.sums_samples, set by the engine), from the
    coupling probe (its halves add up to the whole: coupling/probe.py), or, under pp
    where the probe does not run in the schedule, from pp's question before the cut
    (`take_before_the_cut`) or else the loss function alone on the last stage's first
    micro-batch (`decide_from_halves`). Which kind, and how a mean over the real targets
    counts them, coupling/halves.py decides for all three."""

    def __init__(
        self,
        loss_fn: Any,
        decide_from_halves: bool = False,
        agree: Any = None,
        counts_allowed: bool = True,
    ) -> None:
        self.loss_fn = loss_fn
        self.on = False
        self.global_rows = 1
        self.undecided = decide_from_halves
        # under pp: the batch ranks' distances agreed (their largest), so that every rank
        # of the last stage decides alike; and whether a mean over the real targets may
        # be trained as a pair there (not under cp: its own probe asks about the cut)
        self.agree, self.counts_allowed = agree, counts_allowed
        # a mean over the real (not -100) targets, known from the coupling probe: each
        # call returns (mean x its real targets, its real targets), which the runners sum
        # over ranks and micro-batches and divide by the global count, as one process
        # takes the mean over the whole batch's real targets. Before, each part's mean
        # weighed its own count and the run differed from one process (warned of only)
        self.token_mean = False
        # that mean counted after each row's first target, over targets not `ignored`
        self.shifted, self.ignored = False, halves.IGNORED

    def take(self, verdict: Any) -> None:
        """What the coupling probe found (coupling/probe.py's Verdict, or None)."""
        if verdict is not None:
            self.on = self.on or verdict.summed
            # the model's own loss is counted by ModelOwnLoss (read on its forward's code)
            own = isinstance(self.loss_fn, ModelOwnLoss)
            self.token_mean = verdict.token_mean and not own
            self.shifted, self.ignored = verdict.shifted, verdict.ignored

    def take_before_the_cut(self, verdict: Any) -> None:
        """pp's coupling question on the whole model before the cut, of the user's loss
        on the halves of the first batch's first micro-batch (or of its first four
        samples where a micro-batch holds fewer), the model run on each (coupling/batch.py): a
        sum or a mean over the real targets found there is trained so, and the last
        stage does not ask the loss alone, which cannot take halves of what the model
        reduced itself (a loss returning `outputs.loss`: before, its halves were the
        whole, and the run was warned of and differed). Agreed over every rank."""
        if verdict.summed or verdict.token_mean:
            self.take(verdict)
            self.token_mean = self.token_mean and self.counts_allowed
            self.undecided = False

    def __getattr__(self, name: str) -> Any:  # the wrapped loss's own attributes
        return getattr(self.__dict__["loss_fn"], name)

    def __call__(self, outputs: Any, targets: Any) -> Any:
        value = self.loss_fn(outputs, targets)
        if self.undecided:
            self.undecided = False
            found = _decided_from_halves(self.loss_fn, outputs, targets, value, self.agree)
            self.on, self.shifted, self.ignored = found.summed, found.shifted, found.ignored
            self.token_mean = found.counted and self.counts_allowed
        if self.token_mean and not self.on:
            return _times_real_targets(value, targets, self.shifted, self.ignored)
        if not self.on:
            return value
        loss, count = split_loss(value)
        if count is not None:  # already a pair
            return value
        rows = batch_rows(targets) or batch_rows(outputs)
        return loss * self.global_rows, torch.tensor(float(rows), device=loss.device)


def _times_real_targets(
    value: Any, targets: Any, shifted: bool = False, ignored: int = halves.IGNORED
) -> Any:
    """A mean over the real (not `ignored`) entries of the first integer targets (after
    each row's first where `shifted`) as the pair (mean x count, count); a part with none
    counts 0 (its mean, 0/0, is left out)."""
    loss, count = split_loss(value)
    real = halves.real_targets(targets, shifted, ignored)
    if count is not None or real is None:
        return value
    real = real.sum().to(loss.device)
    total = torch.where(real > 0, loss * real, torch.zeros_like(loss))
    return total, real


def _decided_from_halves(
    loss_fn: Any, outputs: Any, targets: Any, value: Any, agree: Any = None
) -> halves.Kind:
    """A sum over the samples, a mean over the real targets or neither for `loss_fn`, from its
    values on the two halves of the samples (coupling/halves.py); a single sample is
    given twice over, where a sum doubles. The loss function alone, on outputs already
    computed (what a pipeline's last stage can ask); the halves cost less memory than
    the call before them. `agree` takes the distances (relative to `value`) and makes
    them every batch rank's largest, so the ranks that split the batch decide alike."""
    off = _halves_distances(loss_fn, outputs, targets, value, batch_rows(targets))
    distances = torch.tensor(halves.UNKNOWN, dtype=torch.float64) if off is None else off
    if agree is not None:  # on the loss's device: NCCL takes no CPU tensors
        device = next((t.device for t in tensors_in(value)), torch.device("cpu"))
        distances = distances.to(device)
        agree(distances)
    dtype = value.dtype if isinstance(value, torch.Tensor) else None
    return halves.kind(distances, halves.rounding(dtype), halves.noise(dtype))


def _halves_distances(
    loss_fn: Any, outputs: Any, targets: Any, value: Any, rows: int
) -> torch.Tensor | None:
    """halves.distances for `loss_fn` on the halves of `outputs` and `targets`; None
    where the loss cannot be asked."""
    if rows < 1 or not isinstance(value, torch.Tensor) or value.ndim != 0:
        return None

    def twice(tree: Any) -> Any:
        doubled = map_tensors(
            tree, lambda t: torch.cat([t, t]) if t.ndim >= 1 and t.shape[0] == rows else t
        )
        return _as_kind_of(tree, doubled)

    def part(tree: Any, a: int, b: int) -> Any:
        return _as_kind_of(tree, slice_rows(tree, a, b, rows))

    half = halves.telling_split(targets, rows)
    try:
        with torch.no_grad():
            if rows == 1:
                parts = [loss_fn(twice(outputs), twice(targets))]
            else:
                parts = [
                    loss_fn(part(outputs, a, b), part(targets, a, b))
                    for a, b in ((0, half), (half, rows))
                ]
    except Exception:  # noqa: BLE001 - a loss that cannot take parts stays a mean
        return None
    if not all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in parts):
        return None
    whole = float(value.detach().double())
    if rows == 1:  # a sum doubles; no count to weigh by
        doubled, scale = float(parts[0].double()), max(abs(whole), 1e-12)
        sample = [abs(doubled - 2 * whole) / scale, abs(doubled - whole) / scale]
        return torch.tensor(sample + list(halves.UNKNOWN[2:]), dtype=torch.float64)
    a, b = (float(v.double()) for v in parts)
    return halves.distances(whole, a, b, half, rows, targets)


def _as_kind_of(original: Any, part: Any) -> Any:
    """`part` (a slice of `original` that trees made a dict) as the mapping type it was: a
    model's output object (Hugging Face's CausalLMOutputWithPast), whose `.logits` the
    user's loss reads. Before, every half failed there, so a pipeline's last stage never
    found a sum or a mean over the real targets of such a loss."""
    if isinstance(original, Mapping) and type(original) is not dict and isinstance(part, dict):
        with contextlib.suppress(Exception):
            return type(original)(**part)
    return part


def _token_loss_kind(model: Any) -> str | None:
    """ "causal" or "masked" for a Hugging Face model whose loss is the shared causal-LM
    or masked-LM token loss, "tokens" for a token classifier's, "pixels" for a semantic
    segmentation's (by its loss_type, or its class name where that is unset), else None.
    All but "causal" count the labels as they stand (a decoder whose own loss reads its
    labels unshifted is "masked": `_causal_or_as_they_stand`)."""
    loss_type = getattr(model, "loss_type", None) or ""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if loss_type == "ForCausalLM" or (
        not loss_type and name.endswith(("ForCausalLM", "LMHeadModel"))
    ):
        return _causal_or_as_they_stand(model)
    # vision-language models (Qwen2-VL, LLaVA, Gemma 3, ...): transformers maps their
    # loss_type to the causal-LM loss, which their forward calls on their labels. Seq2seq
    # models share the loss_type but compute a mean of their own (T5, BART, Whisper:
    # below), or call it with their labels as `shift_labels=`, as they stand (Moonshine,
    # Florence-2, Canary: the decoder's inputs are the labels shifted right): a token
    # loss counted unshifted, as a masked LM's is. One that shifts them itself first
    # (`labels[..., 1:]`: CSM) stays a mean of its own.
    if loss_type == "ForConditionalGeneration" and _calls_loss_function(model):
        passed = _shift_labels_passed(model)
        return {None: "causal", "as they stand": "masked"}.get(passed)
    # the other encoder-decoders (T5, BART, Whisper, Marian, Pegasus, a vision or speech
    # encoder-decoder): `CrossEntropyLoss()` over the decoder's labels as they stand, a
    # mean over those that are not -100 (before, each rank's mean was averaged: T5 under
    # dp=2 1.3e-2 apart); one that adds other terms (a router's) is no such mean, which
    # the first step's coupling probe finds and refuses, naming the fix
    if getattr(config, "is_encoder_decoder", False) is True and (
        loss_type == "ForConditionalGeneration" or name.endswith("EncoderDecoderModel")
    ):
        return "masked"
    if loss_type == "ForMaskedLM" or (not loss_type and name.endswith("ForMaskedLM")):
        return "masked"
    # token classification (NER, POS tagging): a cross-entropy over the labels that are
    # not -100 (special tokens, padding, a word's later pieces), counted as they stand:
    # transformers' shared loss (Llama, Mistral, ...) or CrossEntropyLoss()'s mean (BERT,
    # RoBERTa, ...). Before, each rank's mean was averaged: BERT under dp=2 6.4e-3 apart.
    if loss_type == "ForTokenClassification" or (
        not loss_type and name.endswith("ForTokenClassification")
    ):
        return "tokens"
    # semantic segmentation (SegFormer, BEiT, DPT, UperNet, MobileViT): a cross-entropy
    # over the pixels that are not config.semantic_loss_ignore_index (255: boundaries,
    # "other"), a mean over them (plus an auxiliary head's over the same pixels). Before,
    # the coupling probe refused it under dp (transformers' code). One label is a binary
    # loss over every pixel (SegFormer's): not counted.
    if (
        loss_type == "ForSemanticSegmentation" or name.endswith("ForSemanticSegmentation")
    ) and getattr(config, "num_labels", 1) > 1:
        return "pixels"
    return None


def _causal_or_as_they_stand(model: Any) -> str:
    """ "causal" for a causal LM whose loss shifts its labels (transformers' shared loss,
    or its own code slicing them); "masked" for one whose own `CrossEntropyLoss()` reads
    them as they stand (the decoders of encoder-decoder stacks: BartForCausalLM, Marian's,
    TrOCR's, Whisper's; XLNet's), counted so."""
    if _calls_loss_function(model):
        return "causal"
    code = _forward_code(model)  # BartForCausalLM's docstring says "not shifted"
    if "CrossEntropyLoss(" in code and "shift" not in code and not _SLICES_LABELS.search(code):
        return "masked"
    return "causal"


def _own_shifted_mean(model: Any) -> bool:
    """Whether a causal LM's own loss is `CrossEntropyLoss()`'s mean over the labels it
    slices one on itself (`labels[..., 1:]`: Clvp's decoder, BLIP's text decoder), read
    on its forward's code: a mean over the shifted labels that are not -100, counted as
    transformers' shared causal loss is. A loss that averages other means (Musicgen's,
    over its codebooks) or reads its labels unsliced is not such a mean."""
    code = _forward_code(model)
    return "CrossEntropyLoss(" in code and _SLICES_LABELS.search(code) is not None


# A forward's code that slices its labels one token on (`labels[..., 1:]`,
# `labels[:, 1:]`): its own shift, which the checks above and below read.
_SLICES_LABELS = re.compile(r"labels\[[^\]]*1:")


def _forward_code(model: Any) -> str:
    """The model's forward's source without its docstrings and comments ("" where it
    cannot be read): what the checks read, so that a docstring's words ("the labels
    are not shifted") are not taken for code."""
    return _code_of(_forward_source(model) or "")


@functools.lru_cache(maxsize=256)
def _code_of(source: str) -> str:
    return re.sub(r'"""[\s\S]*?"""|#[^\n]*', "", source)


def takes_num_items(model: Any) -> bool:
    """Whether the model's loss divides by a given `num_items_in_batch`: an explicit
    parameter of its forward, or `**kwargs` that its forward hands to Hugging Face's
    `self.loss_function` (which does). Checked on the source, since a forward that takes
    **kwargs may drop it (T5's does: its loss is a mean of its own)."""
    import inspect

    forward = type(model).forward
    params = inspect.signature(forward).parameters
    if "num_items_in_batch" in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    # ... and hands them on: transformers' generic token classifier (Llama, Mistral, ...)
    # calls `self.loss_function(logits, labels, self.config)`, a mean, whatever it is given
    calls = _call_arguments(_forward_source(model) or "", "self.loss_function(")
    return any("**kwargs" in call or "num_items_in_batch" in call for call in calls)


def _call_arguments(source: str, call: str) -> list[str]:
    """The argument text of each `call` in `source` (up to its closing parenthesis)."""
    found = []
    start = source.find(call)
    while start >= 0:
        depth, i = 1, start + len(call)
        while depth and i < len(source):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        found.append(source[start + len(call) : i - 1])
        start = source.find(call, i)
    return found


def _shift_labels_passed(model: Any) -> str | None:
    """How the model's forward gives its loss `shift_labels=` (read on its source): None
    when it does not, "as they stand" when it passes its labels unsliced, "other" when
    it slices its labels (its own shift) or its source cannot be read."""
    if _forward_source(model) is None:
        return "other"
    code = _forward_code(model)
    if "shift_labels=" not in code:
        return None
    return "other" if _SLICES_LABELS.search(code) else "as they stand"


def _calls_loss_function(model: Any) -> bool:
    """Whether the model's forward calls Hugging Face's `self.loss_function` (read on its
    source)."""
    return "self.loss_function(" in (_forward_source(model) or "")


def _forward_source(model: Any) -> str | None:
    """The source of the model's class's forward, which the checks above read (None
    where it cannot be read: a compiled or built-in forward); read once per class."""
    return _source_of(type(model).forward)


@functools.lru_cache(maxsize=256)
def _source_of(function: Any) -> str | None:
    import inspect

    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None


def global_token_mean(
    loss_sum: torch.Tensor, count: torch.Tensor, topology: Topology
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global sum / global count, global count) of this rank's (sum, count): one
    all-reduce, in float64 (exact counts); a batch with nothing to count has loss 0."""
    local = torch.stack([loss_sum.double(), count.double()])
    total, items = topology.batch_sum(local).unbind()
    return (total / items.clamp_min(1)).to(loss_sum.dtype), items


def normalise_by_count(
    loss_sum: torch.Tensor,
    count: torch.Tensor,
    topology: Topology,
    model: torch.nn.Module,
    divisor: int,
) -> torch.Tensor:
    """For a (sum, count) loss: the global mean, sum over the global batch / count over
    the global batch, and `model`'s gradients made those of exactly that.

    The runner backpropagated each micro-batch's sum unscaled; the data-parallel
    wrappers averaged the gradients over Topology.grad_average_size ranks and the runner
    divided them by
    `divisor` (the pipeline schedule: its micro-batch count). One all-reduce of (sum,
    count) later, the gradients are scaled by dp_size * divisor / count: the gradient of
    the global token mean, as in one process, however the tokens fall on ranks and
    micro-batches. No second forward; float64 keeps counts exact."""
    from torch.distributed.tensor import DTensor

    mean, items = global_token_mean(loss_sum, count, topology)
    factor = topology.grad_average_size * divisor / items.clamp_min(1)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    with torch.no_grad():  # one kernel per device and dtype
        for (device, dtype), grads in groups.items():
            torch._foreach_mul_(grads, factor.to(device, dtype))
    return mean
