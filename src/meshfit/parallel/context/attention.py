"""Attention over a sequence cut across the cp ranks, exact.

Each rank computes attention for its own queries against the keys and values of the
whole sequence: they are gathered from the cp group (torch's all-gather; the gradient
of each key and value is summed over the ranks whose queries read it and returned to its
rank), with the mask built from every token's place in the sequence: causal by position
(an encoder's layer, transformers' is_causal = False, reads every position instead),
within its document for packed rows, within the sliding window where the layer has one,
never a padding key where the batch's attention_mask pads rows.
Llama 3 chose this all-gather of K/V over ring attention for grouped-query attention,
where K/V are a fraction of the activations; a rank's memory for K/V is then the whole
sequence's K/V of one layer at a time, everything else 1/cp.

The attention of the models people bring is found, not rewritten:
- transformers' models call their attention through the attention-function registry
  (`ALL_ATTENTION_FUNCTIONS.get_interface`: eager, sdpa, flex, ...): inside a cp step
  that lookup returns `hf_attention`, which takes the layer's q, k, v (rotated by the
  rank's own position_ids, which the split passes) and ignores the mask transformers
  built for the local tokens alone (the padding in it comes from the batch's whole
  attention_mask instead, which the split passes too);
- models that call `F.scaled_dot_product_attention` themselves (nanoGPT, meshfit's GPT,
  timm) meet `CausalSDPA`, a torch-function mode that replaces a causal call with the
  exact one (a call with a mask of its own is refused: its mask covers local tokens);
- positions a model makes itself (`torch.arange(T)` for a learned position embedding, as
  nanoGPT and GPT-2's code do) are the rank's own positions inside a cp step
  (`LocalPositions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshfit.errors import MeshfitError
from meshfit.parallel.collectives import gather_with_grad

TOKENS_KEY = "meshfit_tokens"  # (rows, local tokens): each token's place in its sequence
DOCUMENTS_KEY = "meshfit_documents"  # (rows, local tokens): its document in a packed row
PADDING_KEY = "meshfit_padding"  # (rows, local tokens): 1 for a real token, 0 for padding


@dataclass
class SequenceState:
    """The running micro-batch's sequence cut: the positions of this rank's tokens (the
    same for every row), the cp group, and whether targets were shifted before the cut."""

    group: dist.ProcessGroup
    positions: torch.Tensor  # (local tokens,)
    length: int  # the whole sequence
    # (rows, whole sequence): the batch's attention_mask as bools, where it pads a row
    real: torch.Tensor | None = None
    # the additive masks built this micro-batch, shared by every layer: one (local x
    # whole sequence) mask per step, not one per layer (SDPA keeps its mask for backward)
    masks: list[tuple] = field(default_factory=list)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: SequenceState,
    *,
    scale: float | None,
    tokens: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    window: int | None = None,
    padding: torch.Tensor | None = None,
    softmax_fp32: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of this rank's queries `q` (batch, heads, local, dim) over the whole
    sequence's keys and values (`k`, `v`: batch, kv heads, local, dim, gathered here),
    causal by token position unless `causal` is False (an encoder's layer: every key,
    within the window either side where it has one); `softcap`: the scores capped as
    transformers' eager attention caps them (Gemma 2: softcap x tanh(score / softcap)), before the mask;
    `sinks` (heads,): a score per head that takes its share of the softmax and reads
    nothing, as transformers' GPT-OSS eager attention computes it (the softmax in the
    scores' dtype, after subtracting each row's largest). Returns (batch, heads, local,
    dim)."""
    keys = gather_with_grad(k, 2, state.group)
    values = gather_with_grad(v, 2, state.group)
    mask = _mask(state, q, tokens, documents, window, padding, causal)
    grouped = keys.shape[1] != q.shape[1]  # grouped-query attention: a k/v head per group
    if softmax_fp32 or softcap or sinks is not None:  # transformers' eager attention
        if grouped:
            repeat = q.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = scores + mask
            sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            weights = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
            return torch.matmul(weights.to(values.dtype), values)
        weights = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, values)
    # enable_gqa: the narrow K/V kept for backward, not copies repeated per query head
    # (measured on CPU, 8 query heads over 2: 44 MB against 63 MB for one call)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=grouped
    )


def _mask(
    state: SequenceState,
    q: torch.Tensor,
    tokens: torch.Tensor | None,
    documents: torch.Tensor | None,
    window: int | None,
    padding: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """The additive mask (rows, 1, local queries, all keys) of q's dtype: 0 where a query
    may read a key (causal by token position unless not `causal`, within its document,
    within the window (either side, when not causal: transformers' bidirectional window,
    |q - k| < window), a real token where the batch's attention_mask pads rows), -inf
    elsewhere. Built once per micro-batch and window, shared by the layers; one row for every row unless
    documents or padding differ by row. A query with no key left (left padding before a
    row's first real token) reads itself: its output is padding's, never read by a real
    token, and a row of -inf alone would be NaN. A float mask, because
    SDPA on CPU turns a boolean one into a float copy per call and keeps that copy for
    backward (measured: +134 MB per layer at 4,096 x 8,192 tokens)."""
    key = (window, causal, q.dtype, q.device)
    for made_for, by_tokens, by_documents, by_padding, mask in state.masks:
        same = by_tokens is tokens and by_documents is documents and by_padding is padding
        if made_for == key and same:  # `is`: the same micro-batch's tensors
            return mask
    q_tokens = tokens if tokens is not None else state.positions[None]
    if documents is None and padding is None:
        q_tokens = q_tokens[:1]  # every row cut the same: one row serves them all
    q_tokens = q_tokens.to(q.device)
    k_tokens = _gather_plain(q_tokens, state.group)
    allowed = k_tokens[:, None, :] <= q_tokens[:, :, None]
    if not causal:
        allowed = torch.ones_like(allowed)
    if documents is not None:
        docs = documents.to(q.device)
        allowed = allowed & (_gather_plain(docs, state.group)[:, None, :] == docs[:, :, None])
    if window:
        apart = q_tokens[:, :, None] - k_tokens[:, None, :]
        allowed = allowed & ((apart if causal else apart.abs()) < window)
    if padding is not None:  # transformers' padding mask, over the whole sequence's keys
        allowed = allowed & _gather_plain(padding.to(q.device), state.group).bool()[:, None, :]
        lonely = ~allowed.any(-1, keepdim=True)
        allowed = allowed | (lonely & (k_tokens[:, None, :] == q_tokens[:, :, None]))
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill_(~allowed, float("-inf"))[:, None]
    state.masks.append((key, tokens, documents, padding, mask))
    return mask


def _gather_plain(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Integer tensors (positions, documents) of every cp rank along the sequence."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ---- transformers' attention registry ---------------------------------------------------


_UNSAID = object()  # an argument the caller did not pass


def hf_attention(state: SequenceState, implementation: str) -> Callable[..., Any]:
    """A transformers attention function (the registry's signature) computing `attend`:
    q, k, v as the layer made them; the layer's mask ignored (it covers the local
    tokens); positions and documents from the kwargs the split passed down."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: Any = _UNSAID,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if dropout:
            raise MeshfitError(
                f"context parallel does not run attention dropout ({type(module).__name__}: "
                f"p={dropout}); set the model's attention dropout to 0, or train without cp"
            )
        # the window the layer passes, None included (Exaone 4's global layers pass None
        # and keep the sliding layers' size as their attribute: read, it windowed them);
        # else the layer's own (Qwen2-MoE sets it on its sliding layers and passes none)
        if sliding_window is _UNSAID:
            sliding_window = getattr(module, "sliding_window", None)
        # causal unless the call or the layer says not (transformers' sdpa reads them so:
        # an encoder's layers, BERT's and ModernBERT's, set is_causal = False)
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        out = attend(
            query,
            key,
            value,
            state,
            scale=scaling,
            tokens=kwargs.get(TOKENS_KEY),
            documents=kwargs.get(DOCUMENTS_KEY),
            window=sliding_window,
            padding=kwargs.get(PADDING_KEY),
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
            softmax_fp32=implementation == "eager",
            causal=bool(causal),
        )
        return out.transpose(1, 2).contiguous(), None

    return attention


@contextlib.contextmanager
def hf_registry_swapped(state: SequenceState) -> Iterator[None]:
    """transformers' attention lookup answering `hf_attention` while the block runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registry = ALL_ATTENTION_FUNCTIONS
    original = type(registry).get_interface

    def get_interface(self: Any, implementation: str, default: Callable) -> Callable:
        return hf_attention(state, implementation)

    registry.get_interface = get_interface.__get__(registry)
    try:
        yield
    finally:
        del registry.get_interface
        assert type(registry).get_interface is original


# ---- models that call F.scaled_dot_product_attention themselves -----------------------


class CausalSDPA(TorchFunctionMode):
    """F.scaled_dot_product_attention with is_causal=True, made exact over the cp group;
    one with a mask of its own refused (that mask covers the local tokens only); and
    `torch.arange(local length)`, a model's own positions, made the rank's positions."""

    def __init__(self, state: SequenceState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func is torch.arange and self._local_range(args, kwargs):
            positions = self.state.positions
            return positions.to(
                device=kwargs.get("device") or positions.device,
                dtype=kwargs.get("dtype") or torch.long,
            )
        return func(*args, **kwargs)

    def _local_range(self, args: tuple, kwargs: dict) -> bool:
        local = self.state.positions.shape[0]
        ends = [a for a in args if isinstance(a, (int, torch.SymInt))]
        if "end" in kwargs:
            ends.append(kwargs["end"])
        start = kwargs.get("start", ends[0] if len(ends) == 2 else 0)
        end = ends[-1] if ends else None
        step = kwargs.get("step", 1)
        return start == 0 and end == local and step == 1 and len(args) <= 2

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or not is_causal:
            raise MeshfitError(
                "context parallel runs causal attention over the cut sequence, and this "
                "model calls F.scaled_dot_product_attention "
                + ("with a mask of its own" if attn_mask is not None else "without is_causal")
                + ", which covers this rank's tokens only; train it without cp"
            )
        if dropout_p:
            raise MeshfitError(
                f"context parallel does not run attention dropout (p={dropout_p}); set it to "
                f"0, or train without cp"
            )
        return attend(query, key, value, self.state, scale=scale)
