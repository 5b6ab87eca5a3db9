"""Inference after training, under any plan: the model's outputs on a global batch of
inputs, whole, on every rank.

Each data-parallel rank runs its share of the batch (under pp through the pipeline's
own schedule, forward only: the last stage has the outputs in the model's own form and
sends them to the other stages), and the shares are gathered in batch order. The
result holds CPU tensors, so it suits checking and small-scale inference, not serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from meshfit.errors import MeshfitError
from meshfit.runtime.batches import local_inputs, to_device
from meshfit.trees import tensors_in

if TYPE_CHECKING:
    from torch import nn

    from meshfit.runtime.precision import Precision
    from meshfit.runtime.runners import Runner
    from meshfit.topology import Topology


@torch.no_grad()
def predict_global_batch(
    model: nn.Module, runner: Runner, topology: Topology, precision: Precision, inputs: Any
) -> Any:
    """The model (as the forms made it: `model`, run by `runner`) on the global batch
    `inputs` (as the model takes them: a tensor, or a mapping for model(**inputs)); the
    outputs, on every rank."""
    found = tensors_in(inputs)
    if not found:
        raise MeshfitError("predict needs the model's inputs: a tensor, or a mapping of tensors")
    size = found[0].shape[0]
    micro = runner.eval_microbatches
    unit = topology.parts(micro)
    if size % unit:
        raise MeshfitError(
            f"predict's batch of {size} does not split over {topology.dp_size} data-parallel "
            f"rank(s) x {micro} micro-batch(es); give a multiple of {unit}"
        )
    local = to_device(local_inputs(inputs, topology, micro), topology.device)
    was_training = model.training
    model.eval()
    try:
        with precision.autocast():
            outputs = runner.predict(local)
    finally:
        model.train(was_training)
    # torch's pytree keeps the output's own class (a ModelOutput is a dict subclass)
    outputs = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), outputs)
    return _gather_in_batch_order(topology, outputs)


def _gather_in_batch_order(topology: Topology, outputs: Any) -> Any:
    """Every data-parallel share's outputs, concatenated in the batch's order."""
    if topology.world_size == 1 or topology.dp_size == 1:
        return outputs
    shares: list[Any] = [None] * topology.world_size
    dist.all_gather_object(shares, (topology.dp_rank, outputs))
    by_rank = dict(shares)  # any rank of a data-parallel share holds its outputs
    ordered = [by_rank[r] for r in range(topology.dp_size)]
    leaves = [tree_flatten(o) for o in ordered]
    spec = leaves[0][1]
    joined = [
        torch.cat(parts) if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0 else parts[0]
        for parts in zip(*(flat for flat, _ in leaves), strict=True)
    ]
    return tree_unflatten(joined, spec)
