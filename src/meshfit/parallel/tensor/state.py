"""Checkpoint re-layout of weights split chunk by chunk (fused q|k|v): DCP cannot plan
_StridedShard chunks, so they are saved and loaded through a replicated copy that holds
the one-process layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from meshfit.parallel.placements import full_tensor, local_part
from meshfit.topology import TENSOR_PARALLEL


def _is_strided(t: object) -> bool:
    """A DTensor that tensor parallel split chunk by chunk: a `_StridedShard` on the tp
    mesh dimension. FSDP2 over tp-split parameters uses `_StridedShard` on its own
    dimension too; DCP saves and loads those as they are, and re-laying them out here
    broke exact resume of dp x tp x pp with AdamW (measured: losses apart from the
    second step after the resume)."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(
        type(p).__name__ == "_StridedShard"
        and (names[i] if i < len(names) else TENSOR_PARALLEL) == TENSOR_PARALLEL
        for i, p in enumerate(t.placements)
    )


def strided_as_replicated(tree: Any, pairs: list | None = None) -> Any:
    """`tree` (a state dict, nested dicts/lists) with every DTensor split chunk by chunk
    (a fused q|k|v under tp) replaced by a replicated copy: DCP cannot plan a save of
    `_StridedShard` chunks (torch 2.13: "overlapping chunks"). The copy holds the
    one-process layout, so the checkpoint is the same as from any other plan. `pairs`
    collects (original, copy) for `copy_back_strided` after a load."""

    if _is_strided(tree):
        full = full_tensor(tree)  # placements.py: right under FSDP2 too
        replicated = [Replicate()] * len(tree.placements)
        copy = DTensor.from_local(full, tree.device_mesh, replicated, run_check=False)
        if pairs is not None:
            pairs.append((tree, copy))
        return copy
    if isinstance(tree, dict):
        return {k: strided_as_replicated(v, pairs) for k, v in tree.items()}
    if isinstance(tree, list):
        return [strided_as_replicated(v, pairs) for v in tree]
    return tree


@torch.no_grad()
def copy_back_strided(tree: Any, pairs: list) -> Any:
    """`tree` (as DCP loaded it) with each replicated copy's values copied into the
    strided DTensor it stands for, and that DTensor back in its place; every other
    value as loaded (an optimizer's step count is set in the tree, not in place)."""
    originals = {}
    for original, copy in pairs:  # every rank read the full value: no communication
        original.to_local().copy_(local_part(original, copy.to_local()))
        originals[id(copy)] = original
    return _put_back(tree, originals)


def _put_back(tree: Any, originals: dict[int, Any]) -> Any:
    if isinstance(tree, DTensor) and id(tree) in originals:
        return originals[id(tree)]
    if isinstance(tree, dict):
        return {k: _put_back(v, originals) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_put_back(v, originals) for v in tree]
    return tree
