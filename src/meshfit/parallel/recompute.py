"""Activation checkpointing (recomputation) per block, keeping the model's own names.

"full": a block keeps only its input for backward and runs its forward again there
(torch.utils.checkpoint, non-reentrant). "selective": the block keeps the outputs of its
expensive ops (matrix products, attention) and recomputes only the cheap ones (norms,
activations, additions) — most of the memory saved for a few percent of compute (the
op-level policy of torchtitan and Korthikanti et al. 2022).

The block's `forward` is wrapped in place rather than the block in a wrapper module, so
parameter names (and so checkpoints) do not change.
"""

from __future__ import annotations

import functools

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


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recomputation(model: nn.Module, mode: str) -> nn.Module:
    """Recompute each repeated block's activations in backward ("full" or "selective")."""
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        if mode == "selective"
        else None
    )
    for block in find_blocks(model).blocks:
        original = block.forward

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to redo
                return _original(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(_original, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward
    return model
