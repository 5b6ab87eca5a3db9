"""The example batch the forms are shown: pp times its blocks and checks its cut on one
micro-batch, tp traces its split on two samples; from the user's data (fit, predict),
or the first batch the engine is given (engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshfit.runtime.batches import batch_size
from meshfit.trees import batch_rows, slice_rows

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


def of_the_first_batch(topology: Topology, inputs: Any, targets: Any) -> tuple[Any, Any, Any]:
    """What the engine builds on from the first global batch (every rank holds it): the
    forms' example (forms_example), its targets where known (pp's coupling question:
    parallel/compose.py), and, where that example is fewer than four samples (pp with
    small micro-batches), the first four samples' (inputs, targets) for pp's questions
    before the cut (the probe's most; a forward without gradients, far below a step's
    peak): one sample has no halves to compare, and two halves of one sample each often
    hold the same count of real targets. Before, a mean over the real targets was then
    warned of and trained another run, and with one sample a loss coupling the samples
    went unasked."""
    first = lambda n: (slice_rows(inputs, 0, n), None)  # noqa: E731
    rows = batch_size(inputs, "inputs")
    example = forms_example(topology, Examples(first, rows))
    kept = None if example is None or targets is None else batch_rows(example)
    four = min(rows, 4)
    more = topology.plan.pp > 1 and kept is not None and kept < four  # tp's needs none
    asked = (first(four)[0], slice_rows(targets, 0, four)) if more else None
    return example, None if kept is None else slice_rows(targets, 0, kept), asked
