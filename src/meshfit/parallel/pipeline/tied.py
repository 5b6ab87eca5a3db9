"""Weights used before and after the blocks (tied weights) under pipeline parallel.

A language model that ties its LM head to its token embedding uses one Parameter on
the first stage (the embedding) and on the last (the head). As Megatron-LM does with its
"embedding group", both stages keep a copy, the copies start equal (the first stage's
values are sent to the last) and after every backward the two gradients are summed
between the two ranks, so both copies take the same update: the gradient one process
computes for the shared weight is the sum of its uses. The copy on the last stage is
left out of the gradient norm (it would be counted twice). Checkpoints keep each copy
under the name it has on its stage, as one process's `state_dict` keeps both names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshfit.errors import MeshfitError


@dataclass
class TiedWeight:
    """One weight held by a module before the blocks and one after them."""

    head: tuple[nn.Module, str]  # (module, attribute) on the first stage: the embedding
    tail: tuple[nn.Module, str]  # on the last stage: the LM head
    names: tuple[str, str]  # their qualified names, for messages


@dataclass
class TiedWeights:
    """This rank's share of the tied weights: the copies it holds, and the group of the
    two ranks (first stage, last stage) of its pipeline that hold one each."""

    weights: list[TiedWeight]
    group: dist.ProcessGroup | None  # None on a rank that holds neither stage
    first_rank: int  # global rank of the first stage in this rank's pipeline
    has_first: bool
    has_last: bool

    def held(self) -> list[torch.Tensor]:
        """This rank's copies, looked up now (sharding replaces parameter objects)."""
        out = []
        for weight in self.weights:
            for side, holds in ((weight.head, self.has_first), (weight.tail, self.has_last)):
                if holds:
                    module, leaf = side
                    out.append(getattr(module, leaf))
        return out

    def last_stage_copies(self) -> set[int]:
        """ids of the copies the gradient norm leaves out (held by the last stage)."""
        if not self.has_last or self.has_first:
            return set()
        return {id(getattr(m, leaf)) for m, leaf in (w.tail for w in self.weights)}

    @torch.no_grad()
    def broadcast_values(self) -> None:
        """Start both copies from the first stage's values (a model on meta gets them
        alike on every rank when it is materialized)."""
        if self.group is None:
            return
        for tensor in self.held():
            if tensor.is_meta:
                continue
            dist.broadcast(_local(tensor), src=self.first_rank, group=self.group)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Sum the two stages' gradients of every tied weight (after the backward)."""
        if self.group is None:
            return
        for tensor in self.held():
            if tensor.grad is None:  # an unused copy still joins the collective
                tensor.grad = torch.zeros_like(tensor)
            dist.all_reduce(_local(tensor.grad), group=self.group)


def find_tied(
    head: list[tuple[nn.Module, str, nn.Parameter]],
    tail: list[tuple[nn.Module, str, nn.Parameter]],
    names: dict[int, str],
) -> list[TiedWeight]:
    """The parameters that appear before and after the blocks (by identity)."""
    tails = {id(p): (m, leaf) for m, leaf, p in tail}
    found, seen = [], set()
    for module, leaf, param in head:
        if id(param) in tails and id(param) not in seen:  # T5 holds one in 4 modules
            seen.add(id(param))
            tail_module, tail_leaf = tails[id(param)]
            head_name = _qualified(names, module, leaf)
            found.append(
                TiedWeight(
                    head=(module, leaf),
                    tail=(tail_module, tail_leaf),
                    names=(head_name, _qualified(names, tail_module, tail_leaf)),
                )
            )
    return found


def tie_stages(
    weights: list[TiedWeight],
    pp_mesh: DeviceMesh,
    mine: list[int],
    ends_group: dist.ProcessGroup | None,
) -> TiedWeights:
    """This rank's TiedWeights. `ends_group` joins this pipeline's first and last rank
    (Topology.pipeline_ends_group: the pp group itself for pp=2); the middle ranks hold
    no copy."""
    num_stages = len(mine) * pp_mesh.size()
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    first_rank = dist.get_global_rank(pp_mesh.get_group(), 0)
    group = ends_group if (has_first or has_last) else None
    return TiedWeights(weights, group, first_rank, has_first, has_last)


def check_placements(weights: list[TiedWeight]) -> None:
    """Both copies must be split alike (a user's tp plan may shard one and not the
    other), or their local gradients would not line up."""
    for weight in weights:
        head = getattr(*weight.head)
        tail = getattr(*weight.tail)
        if getattr(head, "placements", None) != getattr(tail, "placements", None):
            raise MeshfitError(
                f"{weight.names[0]} is tied to {weight.names[1]} but the tensor-parallel "
                f"plan splits them differently; give both the same style in tp_plan, or "
                f"leave both out of it"
            )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _qualified(names: dict[int, str], module: nn.Module, leaf: str) -> str:
    prefix = names.get(id(module), "")
    return f"{prefix}.{leaf}" if prefix else leaf
