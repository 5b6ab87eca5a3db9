"""The attention the profile runs (planner/profile.py): on `meta`,
`scaled_dot_product_attention` would take its unfused math path and keep a sequence x
sequence score matrix no real run keeps, so it runs as the fused memory-efficient kernel
(what CPU and GPU runs use), whose meta kernel and FLOP count PyTorch ships; elsewhere
the call goes through, its FLOPs added by hand where the counter has no formula for the
kernel (the CPU's has one in parallel/flop_counts.py; a device whose kernel torch has no
formula for still gets the hand count). Each call's keys and values are reported (context parallel gathers
them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode


class FusedAttention(TorchFunctionMode):
    """On `meta`, run scaled_dot_product_attention as the fused memory-efficient kernel
    (the module doc). Elsewhere the call goes through unchanged, and its FLOPs are
    added by hand where the counter has no formula for the kernel."""

    def __init__(
        self, active: bool, counter: FlopCounterMode, attended: Callable[[int], None]
    ) -> None:
        super().__init__()
        self.active = active
        self.counter = counter
        self.attended = attended  # told the bytes of each call's keys and values

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.attended(
            args[1].numel() * args[1].element_size() + args[2].numel() * args[2].element_size()
        )
        if not self.active:
            before = sum(self.counter.get_flop_counts().get("Global", {}).values())
            out = func(*args, **kwargs)
            if sum(self.counter.get_flop_counts().get("Global", {}).values()) == before:
                q, k = args[0], args[1]
                flops = 4 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
                self.counter.flop_counts["Global"][HAND_COUNTED] += flops
            return out
        query, key, value = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        scale = kwargs.get("scale")
        if key.shape[-3] != query.shape[-3]:  # grouped-query attention: heads repeat
            repeat = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(repeat, dim=-3)
            value = value.repeat_interleave(repeat, dim=-3)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        if mask is not None:
            mask = mask.expand(*query.shape[:-1], key.shape[-2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, True, 0.0, bool(causal), scale=scale
        )
        return out[0]


HAND_COUNTED = "scaled_dot_product_attention (counted by meshfit)"
