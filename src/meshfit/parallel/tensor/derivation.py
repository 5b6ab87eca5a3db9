"""What the derivation found (derive.py makes it; check.py, apply.py and meta.py read it):
the plan, the traced input and what the split model is checked against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshfit.parallel.tensor.trace import _Weight


@dataclass
class _Derivation:
    plan: dict[str, str]
    inputs: Any = None  # what the model was traced on (None: a Sequential, not traced)
    # {attention-like module name: {int attribute its forward reads: global value}}
    local_attrs: dict[str, dict[str, int]] = field(default_factory=dict)
    # weight parameters in the plan (experts'), by qualified name: how they are multiplied
    weights: dict[str, _Weight] = field(default_factory=dict)
    # {module holding split weights: positions of its floating-point outputs to sum}
    owners: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # {module (named inside its block): why its weights stay whole}
    whole: dict[str, str] = field(default_factory=dict)
    # replicated parameters inside the blocks that act on column-parallel values (Qwen3's
    # per-head q_norm): each rank's gradient is its heads' part, summed over the tp ranks
    summed: list[str] = field(default_factory=list)
    # whole layers each rank runs for its own heads (multi-query attention's k and v):
    # their input's gradient is each rank's part, summed over the tp ranks
    summed_inputs: list[str] = field(default_factory=list)
    # {whole k/v projection holding fewer heads than tp ranks, more than one: (its head
    # count, head_dim)}: each rank keeps, of its output, the one head its q heads read
    kv_slices: dict[str, tuple[int, int]] = field(default_factory=dict)
