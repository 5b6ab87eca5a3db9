"""The tensor-parallel form's entry: a model with values is split here (apply.py), one on
meta through its one-block twin (meta.py)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfit.parallel.tensor.apply import split_and_check
from meshfit.parallel.tensor.meta import apply_on_meta
from meshfit.parallel.tensor.report import TPReport
from meshfit.parallel.tensor.split import TPPlan


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    tp_plan: TPPlan | None = None,
    example_inputs: Any = None,
    init: Any = None,
    experts_whole: bool = False,
) -> TPReport | None:
    """Shard `model`'s projections over `mesh` (a 1-D tp mesh), in place, and make the
    replicated parameters identical on every tp rank. A derived plan is checked on the
    traced input: the split model must give tp rank 0's one-process output, or it is
    refused. Returns what a derived plan split (None for the user's own tp_plan). A
    model on meta is split as it is, on what a copy of it with one block of each kind
    chose and was checked with (meta.py; `init` as for materialize.py). `experts_whole`:
    a derived plan leaves every experts module whole (expert parallel places them)."""
    if any(p.is_meta for p in model.parameters()):
        return apply_on_meta(model, mesh, tp_plan, example_inputs, init, experts_whole)
    return split_and_check(model, mesh, tp_plan, example_inputs, experts_whole).report
