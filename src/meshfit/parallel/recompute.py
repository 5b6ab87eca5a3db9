"""Activation checkpointing (recomputation) per block, keeping the model's own names.

"full": a block keeps only its input for backward and runs its forward again there
(torch.utils.checkpoint, non-reentrant). "selective": the block keeps the outputs of its
expensive ops (matrix products, attention) and recomputes only the cheap ones (norms,
activations, additions) — most of the memory saved for a few percent of compute (the
op-level policy of torchtitan and Korthikanti et al. 2022).

The block's `forward` is wrapped in place rather than the block in a wrapper module, so
parameter names (and so checkpoints) do not change.

A Hugging Face KV cache handed to a block would be appended to twice (its forward runs
again in backward): GPT-2's attention then saw 24 keys for 12 queries. The training
forward of a recomputed block runs without it (`use_cache=False`, no cache object), as
Hugging Face's own gradient checkpointing does, and says so once; evaluation and
`predict` (no recomputation) keep the cache, and the model itself is not changed.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from meshfit.parallel.blocks import find_blocks

# Ops whose outputs "selective" keeps: the expensive ones to recompute.
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
# a mixture of experts' products (transformers' grouped_mm experts), where torch has it
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE.add(torch.ops.aten._grouped_mm.default)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recomputation(model: nn.Module, mode: str) -> nn.Module:
    """Recompute each repeated block's activations in backward ("full" or "selective")."""
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        if mode == "selective"
        else None
    )
    said: set[str] = set()  # block kinds whose cache was left out (said once per model)
    rebind_forwards(find_blocks(model).blocks, lambda inner: _recomputed(inner, context_fn, said))
    return model


def rebind_forwards(blocks: list[nn.Module], wrap: Callable[[Callable], Callable]) -> None:
    """Give each block `wrap(its forward function)` as its forward, bound to the block
    (see unbound_forward); one wrapper per forward function, shared by its blocks."""
    wrapped: dict[Callable, Callable] = {}
    for block in blocks:
        inner = unbound_forward(block)
        if inner not in wrapped:
            wrapped[inner] = wrap(inner)
        block.forward = types.MethodType(wrapped[inner], block)


def _recomputed(inner: Callable, context_fn: Any, said: set[str]) -> Callable:
    """`inner` (a function of the block and its inputs) run under checkpoint in training."""

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to redo
            return inner(self, *args, **kwargs)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        args, kwargs = without_cache(self, args, kwargs, said, _RECOMPUTE_CACHE)
        return checkpoint(inner, self, *args, use_reentrant=False, **extra, **kwargs)

    return forward


def unbound_forward(block: nn.Module) -> Callable[..., Any]:
    """`block`'s forward as a function of (block, *args): what meshfit wraps and binds
    back with types.MethodType, so that a deep copy of the model rebinds it to the copy's
    block (a closure over the block would keep running the original's weights)."""
    forward = block.forward
    if isinstance(forward, types.MethodType) and forward.__self__ is block:
        return forward.__func__
    return lambda _self, *args, **kwargs: forward(*args, **kwargs)  # a callable of its own


_RECOMPUTE_CACHE = (
    "recomputation runs each {kind}'s forward again in backward, which would append to the "
    "model's KV cache twice; the training forward runs without the cache (use_cache=False), "
    "as Hugging Face's gradient checkpointing does; evaluation and predict keep it"
)


def _is_kv_cache(value: Any) -> bool:
    """A Hugging Face `Cache` (DynamicCache, ...), known by its type's bases so
    transformers is not imported for models that do not use it."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers")
        for c in type(value).__mro__
    )


def without_cache(
    block: nn.Module, args: tuple, kwargs: dict, said: set[str], why: str
) -> tuple[tuple, dict]:
    """`block`'s arguments with no KV cache to append to and `use_cache` off (a block
    that only reads the cache, `_can_checkpoint_with_cache` in transformers, keeps it);
    `why` (with {kind}) is said once per block kind when a cache is left out."""
    if getattr(block, "_can_checkpoint_with_cache", False):
        return args, kwargs
    dropped = any(_is_kv_cache(a) for a in args) or any(_is_kv_cache(v) for v in kwargs.values())
    dropped = dropped or kwargs.get("use_cache") is True
    if not dropped:
        return args, kwargs
    args = tuple(None if _is_kv_cache(a) else a for a in args)
    kwargs = {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache") is True:
        kwargs["use_cache"] = False
    kind = type(block).__name__
    if kind not in said:
        said.add(kind)
        warnings.warn(f"meshfit: {why.format(kind=kind)}", stacklevel=3)
    return args, kwargs
