"""torch's FlopCounterMode with the formulas it lacks: grouped matrix products, and the
CPU's fused attention.

Mixture-of-experts layers run their experts as one grouped matrix product
(`torch._grouped_mm`: transformers 5's default experts kernel, for Mixtral, Qwen2/3-MoE,
OLMoE, ...), for which torch 2.13's FlopCounterMode has no formula: it counted none of
the experts' FLOPs (measured: a Qwen3-MoE block's experts, 45% of its forward FLOPs,
counted 0), so the planner's step time and a pipeline cut balanced on FLOPs saw MoE
layers as their attention alone. The CPU's attention kernel had none either (the
planner's profile added it by hand; a pipeline cut on CPU workers balanced blocks without
their attention). Every FLOP count in meshfit goes through `flop_counter`.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


def grouped_mm_flops(a_shape: torch.Size, b_shape: torch.Size, *args, **kwargs) -> int:
    """FLOPs of `torch._grouped_mm(a, b, offs)` from its operands' shapes: 2 x M x K x N
    for 2-D x 3-D (the experts' forward: rows of `a` (M, K) grouped by `offs`, each group
    times its expert's (K, N) matrix), 2-D x 2-D (a weight's gradient: the K of (M, K) x
    (K, N) grouped) and 3-D x 2-D (N grouped); G times that for 3-D x 3-D, a batch of G
    products (checked: forward and backward of the experts' products count 3x the
    forward)."""
    groups = a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else 1
    return 2 * groups * a_shape[-2] * a_shape[-1] * b_shape[-1]


def cpu_attention_flops(
    query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size, *args, **kwargs
) -> int:
    """FLOPs of the CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu`)
    by torch's own formula for the GPU kernels (grouped-query attention included; no
    saving counted for a causal mask, as there)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def cpu_attention_backward_flops(
    grad_out_shape: torch.Size,
    query_shape: torch.Size,
    key_shape: torch.Size,
    value_shape: torch.Size,
    *args,
    **kwargs,
) -> int:
    """Its backward's: torch's formula (the scores computed again, then four products:
    2.5 x the forward)."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_FORMULAS = {
    "_grouped_mm": grouped_mm_flops,
    "_scaled_grouped_mm": grouped_mm_flops,
    "_scaled_dot_product_flash_attention_for_cpu": cpu_attention_flops,
    "_scaled_dot_product_flash_attention_for_cpu_backward": cpu_attention_backward_flops,
}


def _formulas() -> dict:
    ops = {name: getattr(torch.ops.aten, name, None) for name in _FORMULAS}
    return {op: _FORMULAS[name] for name, op in ops.items() if op is not None}


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode (silent) that also counts grouped matrix products and the CPU's
    fused attention."""
    return FlopCounterMode(display=False, custom_mapping=_formulas())
