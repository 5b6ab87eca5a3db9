"""What tensor parallel split, in numbers (the planner's per-block share) and in the one
line fit prints at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.tensor.split import Split
from meshfit.parallel.tensor.trace import _block_units


@dataclass(frozen=True)
class TPReport:
    """What a derived plan split, as apply_tensor_parallel returns it."""

    # {block class name: fraction of its parameters split over the tp ranks}
    shares: dict[str, float]
    # {Linear outside the blocks split over its outputs, then gathered: output count}
    heads: dict[str, int] = field(default_factory=dict)
    # {module inside a block, or a head outside them: why tp left its weights whole}
    whole: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str | None:
        """One line, e.g. "tensor parallel splits 99.6% of GPT2Block parameters" (None:
        nothing in the blocks was split)."""
        if not self.shares:
            return None
        parts = ", ".join(f"{100 * v:.1f}% of {k} parameters" for k, v in self.shares.items())
        heads = "".join(
            f" and {name} over its {n} outputs (gathered)" for name, n in self.heads.items()
        )
        kept = "".join(f"; {owner} kept whole: {why}" for owner, why in sorted(self.whole.items()))
        return f"tensor parallel splits {parts}{heads}{kept}"


def tp_share(model: nn.Module, plan: dict[str, str]) -> dict[str, float]:
    """{block class name: fraction of that kind of block's parameters (by count) that
    `plan` splits over the tp ranks}: a column-parallel weight and bias, a row-parallel
    weight (its bias stays whole on every rank)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    split: dict[str, int] = {}
    total: dict[str, int] = {}
    if type(model) is nn.Sequential:  # its layers are the pairs: one kind, the model
        units = [("", model)]
    else:
        units = _block_units(model, find_blocks(model))
    for unit, block in units:
        kind = type(block).__name__
        total[kind] = total.get(kind, 0) + sum(p.numel() for p in block.parameters())
        prefix = f"{unit}." if unit else ""
        for name, style in plan.items():
            if name.startswith(prefix):
                split[kind] = split.get(kind, 0) + split_numel(modules, params, name, style)
    return {kind: split.get(kind, 0) / n for kind, n in total.items() if n}


def split_numel(
    modules: dict[str, nn.Module], params: dict[str, nn.Parameter], name: str, style: object
) -> int:
    """Parameter elements plan entry `name` splits: a column-parallel weight and bias, a
    row-parallel weight (its bias stays whole), an experts' weight parameter."""
    if name in params and name not in modules:  # an experts' weight parameter
        return params[name].numel()
    module = modules.get(name)
    if module is None or getattr(module, "weight", None) is None:
        return 0
    count = module.weight.numel()
    bias = getattr(module, "bias", None)
    split = Split.parse(style) if isinstance(style, str) else None
    if split is not None and split.column and bias is not None:
        count += bias.numel()
    return count
