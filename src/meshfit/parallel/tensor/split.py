"""What a split is and which layers take one: the plan's styles, the projection layers
(nn.Linear, Hugging Face's Conv1D, plain convolutions), the per-channel layers split
with them (BatchNorm) and the attribute names that hold head counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

TPPlan = dict[str, "str | ParallelStyle"]


@dataclass(frozen=True)
class Split:
    """One plan entry, parsed: "colwise", "rowwise", or "colwise:N" (a fused projection
    whose output is N equal chunks, q|k|v, each split over the ranks on its own; "rowwise:N"
    the same on the input side). Plans
    keep the text (users write it, fit prints it); code reads it through `parse` only."""

    kind: str  # "colwise" | "rowwise"
    chunks: int = 1

    @classmethod
    def parse(cls, style: str) -> Split | None:
        """The Split `style` names; None for text that names none."""
        kind, sep, chunks = style.partition(":")
        if kind not in STYLES or (sep and not chunks.isdigit()):
            return None
        return cls(kind, int(chunks) if sep else 1)

    @property
    def column(self) -> bool:
        return self.kind == "colwise"

    def __str__(self) -> str:
        return f"{self.kind}:{self.chunks}" if self.chunks > 1 else self.kind


# q/k/v layers as the common families name them: only to find the head count on the
# model's config when a hand-written plan splits them (check_tp_plan).
QKV_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"}

HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")

KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


# Layers that act on each element (or each position) alone: a column-parallel output
# can pass through them to a row-parallel Linear unchanged.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
               nn.Mish, nn.Identity, nn.Dropout)  # fmt: skip


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module) or _is_conv(module)


def _is_conv(module: nn.Module) -> bool:
    """A plain convolution (nn.Conv1d/2d/3d, not grouped, not transposed): a matrix
    product over its input channels at each position, which Megatron's pairs split as a
    Linear's features (weight (out, in, *kernel): output channels on dim 0, input
    channels on dim 1). A grouped or depthwise one mixes no channels across groups."""
    return (
        isinstance(module, nn.modules.conv._ConvNd) and not module.transposed and module.groups == 1
    )


def _is_channel_layer(module: nn.Module) -> bool:
    """A layer that acts on each channel alone with per-channel parameters and
    statistics (BatchNorm): between a column-parallel convolution and its row-parallel
    partner, it is split by channel with them."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 style Conv1D (weight (in, out), y = x @ W + b), by class name so
    transformers is not imported for models that do not use it."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def _dims(module: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a projection."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if _is_conv(module):
        return module.in_channels, module.out_channels
    rows, cols = module.weight.shape  # Conv1D: (in, out)
    return rows, cols


def largest_tp(model: nn.Module, plan: dict[str, str]) -> int:
    """The greatest common divisor of what tp must divide under `plan`: split widths and
    head counts (the planner's limit on tp)."""
    import math

    sizes = []
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules.get(name)
        if module is None or not _is_projection(module):
            continue
        split = Split.parse(style)
        chunks = split.chunks
        in_dim, out_dim = _dims(module)
        sizes.append((out_dim // chunks) if split.column else in_dim)
    config = getattr(model, "config", None)
    for attr in (*HEAD_ATTRS, *KV_HEAD_ATTRS):
        value = getattr(config, attr, None) if config is not None else None
        for module in modules.values():
            value = value or getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            sizes.append(value)
    return math.gcd(*sizes) if sizes else 1
