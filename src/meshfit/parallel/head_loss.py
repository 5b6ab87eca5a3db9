"""`chunked_loss=True`: the LM head's product and the cross-entropy computed a chunk of
tokens at a time, so no step ever holds the whole logits.

A language model's last Linear maps every token to the vocabulary: at 8,192 tokens a
step and a 128,256-word vocabulary that is 1.05G logits, 4.2 GB in float32 and as much
again for their gradient, more than the rest of a 1B model's activations. Here the head
does not compute them. While a training or evaluation step runs (the runner arms it),
the head returns a stand-in of the logits' shape (NaN, a stride-0 view: nothing
allocated) and records its input; the loss that receives the stand-in (meshfit's
`mf.losses.cross_entropy`, or a Hugging Face model's own causal-LM or masked-LM loss,
which meshfit swaps for the step) computes the same sum from the head's input and
weight, `CHUNK_LOGITS` logits at a time, and the gradients of the head's input, weight
and bias in the same pass (as Liger-Kernel's fused linear cross-entropy does): three
matrix products per chunk, as the whole computation has, and only one chunk's logits
alive at any moment.

Equal to the whole computation: the same products in the same precision (under autocast
the chunk's product is bf16 and the loss float32, as `logits.float()` makes it), summed
per chunk; tested in float64 against it under one process, dp, fsdp, tp, pp and cp, tied
heads and the model's own loss included (tests/test_head_loss.py).

Under tensor parallel a head split over the vocabulary runs its chunks over each rank's
rows, with Megatron-LM's vocab-parallel cross-entropy (`_vocab_parallel_chunk`): the
logits are never gathered. Where it does not apply it says so instead of guessing: a model
that changes its logits between the head and the loss (Gemma 2's soft-capping, Cohere's
scale) or a loss that reads them otherwise is refused at the first step in one line,
since the stand-in holds no values; metrics, which read the logits, are refused at build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from meshfit.errors import MeshfitError

# Logits per chunk: 64M, 256 MB in float32 (512 tokens of a 128,256-word vocabulary).
# Large enough that each chunk's three products run at the matrix units' rate, small
# next to the whole (1.05G logits at 8,192 tokens x 128k words).
CHUNK_LOGITS = 1 << 26

# Whether a step is running with the head deferred (a stack: the runner arms it around
# a micro-batch's forward and loss), and the head outputs the loss has not taken yet:
# (stand-in, the head's input, weight, bias, tokens per chunk).
_ARMED = [False]
_PENDING: list[Deferred] = []

_NOT_REACHED = (
    "chunked_loss=True computes the loss from the LM head's input, but the head's output "
    "{how}: the model may change its logits before its loss (soft-capping or a scale, as "
    "Gemma 2 and Cohere do) or a loss reads them otherwise; train with chunked_loss=False"
)


class Deferred(NamedTuple):
    """A head's output the loss has not taken yet: the stand-in it returned, its input,
    weight and bias (this rank's rows under tp), tokens per chunk, and under tp the group
    its vocabulary is split over."""

    stand_in: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    chunk: int
    group: Any = None

    def loss(
        self, targets: torch.Tensor, ignore_index: int, loss_dtype: Any = None, shift: bool = False
    ) -> torch.Tensor:
        """The summed cross-entropy of the head's logits against `targets`
        (position t against target t + 1 with `shift`)."""
        hidden = self.hidden[..., :-1, :] if shift else self.hidden
        return linear_cross_entropy(
            hidden,
            self.weight,
            self.bias,
            targets,
            ignore_index,
            self.chunk,
            loss_dtype,
            self.group,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    loss_dtype: torch.dtype | None = None,
    group: Any = None,
) -> torch.Tensor:
    """The summed cross-entropy of `F.linear(hidden, weight, bias)` against `targets`
    (tokens whose target is `ignore_index` count for nothing), computed `chunk_tokens`
    tokens at a time (default: CHUNK_LOGITS logits a chunk). The logits are widened to
    float32 at least (`mf.losses.cross_entropy`'s rule), or cast to `loss_dtype` (float32
    for transformers' losses, whose `logits.float()` narrows float64 too).
    Differentiable in hidden, weight and bias. With `group` (tensor parallel), `weight`
    and `bias` are this rank's rows of a head split evenly over the vocabulary across
    the group's ranks, and the loss is that of the whole vocabulary (below)."""
    vocab = weight.shape[0]
    chunk = chunk_tokens or max(1, CHUNK_LOGITS // vocab)
    flat = hidden.reshape(-1, hidden.shape[-1])
    _check_targets(targets, flat.shape[0])
    try:
        return _LinearCrossEntropy.apply(
            flat, weight, bias, targets.reshape(-1), ignore_index, chunk, loss_dtype, group
        )
    except (RuntimeError, IndexError) as exc:  # out-of-range ids fail in the gather
        words = vocab * (torch.distributed.get_world_size(group) if group is not None else 1)
        _check_target_range(targets, words, ignore_index, exc)
        raise


def _check_targets(targets: torch.Tensor, tokens: int) -> None:
    """What the whole computation's cross-entropy would refuse as the user's batch, said
    here, before meshfit's own chunked computation would fail on it (its errors are
    meshfit's, runtime/batch_errors.py): shape and dtype only, no read of the values."""
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise MeshfitError(
            f"the loss's targets must be token ids (integers), not {targets.dtype}; give "
            f"labels as int64 (a collator's `labels`, -100 where a token does not count)"
        )
    if targets.numel() != tokens:
        raise MeshfitError(
            f"the loss's targets hold {targets.numel()} tokens but the LM head was given "
            f"{tokens}: give labels of the inputs' shape (one id per token)"
        )


def _check_target_range(targets: torch.Tensor, words: int, ignore: int, exc: Exception) -> None:
    """After the chunked computation failed: a target id outside the vocabulary (and not
    the ignored one) is the batch's, said as such; otherwise the error is meshfit's."""
    counted = targets[targets != ignore]
    if not counted.numel():
        return
    low, high = int(counted.min()), int(counted.max())
    if low < 0 or high >= words:
        bad = low if low < 0 else high
        raise MeshfitError(
            f"a target token id is {bad}, outside the vocabulary's 0..{words - 1} (and not "
            f"the ignored {ignore}): give labels the model's vocabulary holds"
        ) from exc


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when gradients are wanted, the gradients of the
    summed loss too (chunk by chunk, nothing of the logits kept); backward scales them
    by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, chunk, loss_dtype, group):  # type: ignore[override]
        wants = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)
        total = None
        grad_h = torch.empty_like(hidden) if wants[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if wants[1] else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if wants[2] else None
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            part, rows = _one_chunk(
                h, t, weight, bias, ignore_index, loss_dtype, group, wants, grad_w, grad_b
            )
            total = part if total is None else total + part
            if grad_h is not None and rows is not None:
                grad_h[start : start + chunk] = rows
            del rows  # not beside the next chunk's
        if group is not None and grad_h is not None:
            torch.distributed.all_reduce(grad_h, group=group)
        ctx.save_for_backward(
            *(x if x is not None else torch.empty(0) for x in (grad_h, grad_w, grad_b))
        )
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        wants = ctx.needs_input_grad[:3]
        w_dtype, b_dtype = ctx.dtypes
        return (
            grad_h * grad_total.to(grad_h.dtype) if wants[0] else None,
            (grad_w * grad_total).to(w_dtype) if wants[1] else None,
            (grad_b * grad_total).to(b_dtype) if wants[2] else None,
            None,
            None,
            None,
            None,
            None,
        )


def _one_chunk(
    h: torch.Tensor,
    t: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    loss_dtype: torch.dtype | None,
    group: Any,
    wants: tuple[bool, ...],
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss and, when wanted, its hidden rows' gradient (returned) and
    the weight's and bias's (added into grad_w, grad_b). Each of the chunk's buffers is let
    go once used: a chunk's logits at 128k words are 256 MB in float32, and a loop that
    kept them in its variables made the next chunk's beside them (measured on the CPU:
    one chunk more at the peak)."""
    logits = F.linear(h, weight, bias)
    dtype = logits.dtype
    if group is not None:
        part, g, real = _vocab_parallel_chunk(logits, t, ignore_index, loss_dtype, group, wants)
        del logits
        if g is None:
            return part, None
    else:
        # one pass over the chunk's logits for the loss (log_softmax widens as it
        # reads, as the whole computation's .float() and cross_entropy do) ...
        wide = loss_dtype or torch.promote_types(dtype, torch.float32)
        logp = torch.log_softmax(logits, dim=-1, dtype=wide)
        del logits
        real = (t != ignore_index)[:, None]
        picked = torch.where(real, t[:, None], 0)
        part = -(logp.gather(1, picked) * real).sum()
        if not any(wants):
            return part, None
        # ... and two for d(loss)/d(logits) = softmax - one-hot, in the logits' dtype.
        # An ignored token's row is not zeroed here (a pass more): its hidden row is
        # masked in the weight's gradient and its own gradient row zeroed below.
        g = logp.exp_()
        del logp
        g.scatter_add_(1, picked, -torch.ones_like(g[:, :1]))
        g = g.to(dtype)
    rows = None
    if wants[0]:  # under tp this rank's share of it: the caller sums it over the ranks
        rows = ((g @ weight.to(g.dtype)) * real).to(h.dtype)
    if grad_w is not None:
        grad_w += (g.t() @ (h * real).to(g.dtype)).to(grad_w.dtype)
    if grad_b is not None:
        grad_b += (g * real).sum(0).to(grad_b.dtype)
    return part, rows


def _vocab_parallel_chunk(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    loss_dtype: torch.dtype | None,
    group: Any,
    wants: tuple[bool, ...],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One chunk's summed loss over a vocabulary split across `group` (this rank holds
    the logits of its rows: rank r the words [r * V/n, (r + 1) * V/n)), and this rank's
    columns of d(loss)/d(logits) (None without gradients), and the real-token mask.

    Megatron-LM's vocab-parallel cross-entropy, a chunk at a time: each token's
    log-sum-exp combined from the ranks' own (an all-gather of one number per token and
    rank), its target's logit from the rank that holds that word (an all-reduce of one
    number per token). The alternative, torch's loss_parallel, takes the chunk's logits
    as a DTensor and keeps them for its backward; the whole-vocabulary head all-gathers
    every logit (tokens x V: 84 ms for 66 MB over gloo on the 2-core VM, BENCHMARKS.md
    "Tensor parallel: the LM head split"). Here a token costs 2 x ranks numbers."""
    import torch.distributed as dist

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = logits.shape[-1]
    z = logits.to(loss_dtype or torch.promote_types(logits.dtype, torch.float32))
    lse = _logsumexp(z)
    every = torch.empty(ranks * lse.numel(), dtype=lse.dtype, device=lse.device)
    dist.all_gather_into_tensor(every, lse.contiguous(), group=group)
    lse = torch.logsumexp(every.view(ranks, -1), dim=0)
    real = targets != ignore_index
    local = targets - rank * rows
    here = real & (local >= 0) & (local < rows)
    index = torch.where(here, local, 0)[:, None]
    picked = z.gather(1, index).squeeze(1) * here
    dist.all_reduce(picked, group=group)
    part = ((lse - picked) * real).sum()
    if not any(wants):
        return part, None, real[:, None]
    g = (z - lse[:, None]).exp_()  # in place: the chunk's logits and one copy at once
    g.scatter_add_(1, index, -here.to(g.dtype)[:, None])
    return part, g.to(logits.dtype), real[:, None]


def _logsumexp(z: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dimension with one temporary the size of `z`, not
    two (its z - max and the exp of that): measured under tp=2, a 128k-word Llama's
    chunked step peaked with three copies of a chunk's logits where the one-rank path
    holds two."""
    if z.shape[-1] == 0:  # no words on this rank: torch's answer, -inf
        return torch.logsumexp(z, dim=-1)
    top = z.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows of -inf
    return (z - top).exp_().sum(dim=-1).log_() + top.squeeze(-1)


# ---- the head deferred during a step -------------------------------------------------


@contextlib.contextmanager
def deferred_head() -> Iterator[None]:
    """Around one micro-batch's forward and loss (the runners enter it): chunked heads
    return a stand-in and their input goes to the loss; a head output the loss did not
    take is refused when it ends."""
    _ARMED.append(True)
    _PENDING.clear()
    try:
        yield
        if _PENDING:
            raise MeshfitError(_NOT_REACHED.format(how="never reached the loss"))
    finally:
        _ARMED.pop()
        _PENDING.clear()


def take_deferred(logits: Any) -> Deferred | None:
    """The chunked head's output when `logits` is its stand-in (or, under tp, the local
    view DTensor hands on of it), else None; refuses logits made from a stand-in (their
    values are not the logits)."""
    if not _PENDING:
        return None
    for i, deferred in enumerate(_PENDING):
        if logits is deferred.stand_in or _same_view(logits, deferred.stand_in):
            del _PENDING[i]
            return deferred
    raise MeshfitError(_NOT_REACHED.format(how="was changed before the loss"))


def is_stand_in(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is (a view of) a chunked head's stand-in the loss has yet to take."""
    return any(tensor is d.stand_in or _same_view(tensor, d.stand_in) for d in _PENDING)


def _same_view(a: Any, b: torch.Tensor) -> bool:
    """`a` is a view of `b`'s whole memory, of the same shape (DTensor's to_local hands
    on a new tensor object over the same memory)."""
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _stand_in(hidden: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """NaN of the logits' shape without their memory: a value read from it poisons what
    it feeds, so a use meshfit did not foresee shows, never passes silently."""
    return torch.full((), float("nan"), dtype=dtype, device=hidden.device).expand(
        *hidden.shape[:-1], vocab
    )


def _deferred_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not _ARMED[-1]:
        return self._meshfit_base_forward(hidden)
    weight, bias, group = self.weight, self.bias, None
    if isinstance(weight, DTensor):  # tp split it over the vocabulary (ColwiseParallel)
        if not _split_by_rows(weight, bias):
            return self._meshfit_base_forward(hidden)
        mesh = weight.device_mesh
        group = mesh.get_group()
        weight = weight.to_local()
        bias = bias.to_local() if bias is not None else None
        hidden = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    dtype = (
        torch.get_autocast_dtype(hidden.device.type)
        if torch.is_autocast_enabled(hidden.device.type)
        else torch.promote_types(hidden.dtype, weight.dtype)
    )
    stand_in = _stand_in(hidden, self.out_features, dtype)
    _PENDING.append(Deferred(stand_in, hidden, weight, bias, self._meshfit_chunk_tokens, group))
    if group is None:
        return stand_in
    from torch.distributed.tensor import Replicate

    # what the split head's output hook expects: the logits whole (Replicate), so it
    # gathers nothing and hands on a view of the stand-in
    return DTensor.from_local(stand_in, mesh, [Replicate()], run_check=False)


def _split_by_rows(weight: Any, bias: Any) -> bool:
    """The weight (and bias) split evenly by rows over a one-dimensional mesh: the
    vocabulary split that the chunks over shards handle."""
    from torch.distributed.tensor import Shard

    def rows(t: Any) -> bool:
        return (
            t.device_mesh.ndim == 1
            and tuple(t.placements) == (Shard(0),)
            and t.shape[0] % t.device_mesh.size() == 0
        )

    return rows(weight) and (bias is None or rows(bias))


_CLASSES: dict[type, type] = {}


def _chunked_class(cls: type) -> type:
    if cls not in _CLASSES:
        methods = {"forward": _deferred_forward, "_meshfit_base_forward": cls.forward}
        _CLASSES[cls] = type(f"Chunked{cls.__name__}", (cls,), methods)
    return _CLASSES[cls]


def chunked_loss_for(model: nn.Module, loss_fn: Any, option: bool | int, rank: int) -> bool:
    """Install the deferred head for `chunked_loss=option` (True: CHUNK_LOGITS logits a
    chunk; a number: that many tokens a chunk) when the loss can take it; say so on rank
    0. Refuses, in one line, a loss that reads the logits itself."""
    kind = getattr(loss_fn, "deferred_head", None)
    if kind == "metrics":
        raise MeshfitError(
            "chunked_loss=True never computes the whole logits, and metrics= read them; "
            "drop the metrics (evaluate computes the loss) or train with chunked_loss=False"
        )
    if kind is None:
        raise MeshfitError(
            f"chunked_loss=True computes the loss itself from the LM head's input, which it "
            f"can for loss_fn=mf.losses.cross_entropy(...) and for loss_fn='model' on a "
            f"Hugging Face causal or masked LM; {_name(loss_fn)} is neither: use one of "
            f"those or chunked_loss=False"
        )
    chunk = None if option is True else int(option)
    head = install(model, chunk, kind if kind != "outputs" else None)
    if rank == 0:
        from torch.distributed.tensor import DTensor

        split = ""
        if isinstance(head.weight, DTensor):
            split = (
                f", each tp rank over its {head.out_features // head.weight.device_mesh.size():,}"
            )
        print(
            f"meshfit: chunked_loss: the LM head's logits ({head.out_features:,} words{split}) "
            f"computed {head._meshfit_chunk_tokens:,} tokens at a time, never whole",
            flush=True,
        )
    return True


def _name(loss_fn: Any) -> str:
    while type(loss_fn).__name__ == "SampleSum":  # the engine's wrapper (losses.py)
        loss_fn = loss_fn.loss_fn
    if type(loss_fn).__name__ == "ModelOwnLoss":
        return "loss_fn='model' on this model (not Hugging Face's token loss)"
    return f"loss_fn={getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}"


def holds_deferred_head(module: nn.Module) -> bool:
    """Whether `module` holds an LM head that defers to the loss (install): its weight
    is read by the loss after the module's forward has returned."""
    return any(hasattr(m, "_meshfit_chunk_tokens") for m in module.modules())


def find_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head: `get_output_embeddings()` (Hugging Face models), else a
    Linear named `lm_head` (nanoGPT, meshfit's GPT); None when there is neither."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


def install(model: nn.Module, chunk_tokens: int | None, model_loss_kind: str | None) -> nn.Linear:
    """Make `model`'s LM head defer to the loss inside a step (its class becomes a
    subclass whose forward does; outside a step it is the Linear it was), and, for the
    model's own loss, wrap its `loss_function` to take the deferred head. Returns the
    head; refuses a model without one."""
    head = find_head(model)
    if head is None:
        raise MeshfitError(
            f"chunked_loss=True needs the model's LM head, but {type(model).__name__} has "
            f"no get_output_embeddings() Linear and no Linear named lm_head; train with "
            f"chunked_loss=False"
        )
    head.__class__ = _chunked_class(type(head))
    head._meshfit_chunk_tokens = chunk_tokens or max(1, CHUNK_LOGITS // head.out_features)
    if model_loss_kind is not None:
        model.loss_function = _ModelLoss(model.loss_function, model_loss_kind == "causal")
    return head


class _ModelLoss:
    """A Hugging Face model's own causal-LM / masked-LM loss (transformers'
    ForCausalLMLoss / ForMaskedLMLoss: the same labels, shift and reduction) over a
    deferred head; the library's own function on real logits."""

    def __init__(self, original: Callable[..., Any], causal: bool) -> None:
        self.original = original
        self.causal = causal

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        deferred = take_deferred(logits)
        if deferred is None:
            extra = {"shift_labels": shift_labels} if shift_labels is not None else {}
            return self.original(
                logits, labels, vocab_size, num_items_in_batch, ignore_index, **extra, **kwargs
            )
        # given `shift_labels`, the loss reads them as they stand (a seq2seq model passes
        # its labels so, with labels=None: Moonshine, Florence-2)
        if shift_labels is None:
            shift_labels = (
                F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if self.causal else labels
            )
        targets = shift_labels.to(deferred.hidden.device)
        total = deferred.loss(targets, ignore_index, loss_dtype=torch.float32)
        if num_items_in_batch is None:  # the library's mean
            return total / (targets != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
