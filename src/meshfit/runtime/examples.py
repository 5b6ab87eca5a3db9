"""The example batch the forms are shown: pp times its blocks and checks its cut on one
micro-batch, tp traces its split on two samples; from the user's data (fit, predict),
or the first batch the engine is given (engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshfit.topology import Topology

# (inputs, targets) of the first n samples of the user's data, None when it has none
FirstSamples = Callable[[int], "tuple[Any, Any] | None"]


@dataclass(frozen=True)
class Examples:
    """The user's own data as the planner and the forms see it: `first(n)` gives the
    first n samples as one (inputs, targets) batch; `batch_size` is the global batch."""

    first: FirstSamples
    batch_size: int


def forms_example(topology: Topology, examples: Examples) -> Any:
    """The inputs the forms are shown: under a pipeline plan one micro-batch (its blocks'
    FLOPs, counted on it, balance the stages; the cut is checked on it); under tensor
    parallel two samples (the split is traced and checked on them: the user's batch, not
    one meshfit makes up, since a vision or speech model takes no token ids); None for
    the other plans, which use none."""
    plan = topology.plan
    if plan.pp == 1 and plan.tp == 1:
        return None
    size = topology.microbatch_size(examples.batch_size)
    batch = examples.first(size if plan.pp > 1 else min(size, 2))
    return None if batch is None else batch[0]
