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


def _forms_batch(topology: Topology, examples: Examples) -> tuple[Any, Any] | None:
    """The (inputs, targets) the forms are shown: under a pipeline plan one micro-batch
    (its blocks' FLOPs, counted on it, balance the stages; the cut is checked on it);
    under tensor parallel two samples (the split is traced and checked on them: the
    user's batch, not one meshfit makes up, since a vision or speech model takes no token
    ids); None for the other plans, which use none."""
    plan = topology.plan
    if plan.pp == 1 and plan.tp == 1:
        return None
    size = topology.microbatch_size(examples.batch_size)
    return examples.first(size if plan.pp > 1 else min(size, 2))


# what the engine builds on: (the forms' example inputs, their targets where known, the
# first four samples' (inputs, targets) for pp's questions before the cut, or None)
BuildExample = tuple[Any, Any, Any]


def to_build_on(topology: Topology, examples: Examples) -> BuildExample:
    """What the engine builds on from the user's data: the forms' example
    (_forms_batch's inputs), its targets where known (pp's coupling question:
    parallel/compose.py), and, where that example is fewer than four samples (pp with
    small micro-batches), the first four samples' (inputs, targets) for pp's questions
    before the cut (the probe's most; a forward without gradients, far below a step's
    peak): one sample has no halves to compare, and two halves of one sample each often
    hold the same count of real targets. Before, a mean over the real targets was then
    warned of and trained another run, and with one sample a loss coupling the samples
    went unasked. fit and predict take it from their dataset (prepare.py), the engine
    otherwise from the first batch it is given (of_the_first_batch)."""
    batch = _forms_batch(topology, examples)
    if batch is None:
        return None, None, None
    example, targets = batch
    four = min(examples.batch_size, 4)
    if topology.plan.pp == 1 or targets is None or batch_rows(example) >= four:
        return example, targets, None  # tp's needs no more
    return example, targets, examples.first(four)


def of_the_first_batch(topology: Topology, inputs: Any, targets: Any) -> BuildExample:
    """to_build_on the first global batch the engine is given (every rank holds it)."""

    def first(n: int) -> tuple[Any, Any]:
        return slice_rows(inputs, 0, n), None if targets is None else slice_rows(targets, 0, n)

    return to_build_on(topology, Examples(first, batch_size(inputs, "inputs")))
