"""A DTensor's full tensor from its local shards, and back, right for the one layout
DTensor itself gets wrong.

Tensor parallel splits a fused projection chunk by chunk (q|k|v: each tp rank keeps its
part of q, of k and of v; `_StridedShard(d, split_factor=3)`). When FSDP2 then shards that
tensor's tp-local part on the same dimension (a fused bias: 1-D, so FSDP2 has no other
dimension), it labels its own dimension `_StridedShard(d, split_factor=tp)` as if tp's
split were a plain one. DTensor cannot invert that pair: measured in torch 2.13 on GPT-2's
`c_attn.bias` under fsdp=2,tp=2, `full_tensor()` returned the values scrambled and partly
zero-filled, while training itself was exact (each rank's local shard is right). Every
gathered state (full_state_dict, save_model, checkpoints, export) then held wrong values.

For that layout the local shard is FSDP2's: torch.chunk of the tp rank's part along the
dimension, over the data-parallel shard ranks. So the full tensor is the tp part gathered
over those ranks (an all-gather of the shards; the hand-written collective exists because
DTensor's own gives wrong values), then tp's chunk-by-chunk split undone by DTensor (which
it gets right alone); and the local shard of a full tensor is the same two steps backwards,
with no communication. Every other layout goes to DTensor as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshfit.topology import TENSOR_PARALLEL


def _strided(p: object) -> bool:
    return type(p).__name__ == "_StridedShard"


def _shard(p: object) -> bool:
    """A placement that splits a tensor dimension: a Shard, or tp's chunk-by-chunk
    `_StridedShard` (not a Shard subclass in every torch release)."""
    return isinstance(p, Shard) or _strided(p)


def _nested(t: DTensor) -> tuple[int, int] | None:
    """(tp's mesh dim, the data-parallel shard's mesh dim) when `t` is tp's chunk-by-chunk
    split sharded again by FSDP2 on the same tensor dimension; else None."""
    names = t.device_mesh.mesh_dim_names or ()
    if TENSOR_PARALLEL not in names:
        return None
    tp = names.index(TENSOR_PARALLEL)
    tp_placement = t.placements[tp]
    if not _strided(tp_placement):
        return None
    for i, p in enumerate(t.placements):
        if i != tp and _shard(p) and p.dim == tp_placement.dim:
            return tp, i
    return None


def full_tensor(t: DTensor) -> torch.Tensor:
    """The full tensor of `t`, on every rank of its mesh (a collective over it)."""
    dims = _nested(t)
    if dims is None:
        return t.full_tensor()
    tp, shard = dims
    mesh, dim = t.device_mesh, t.placements[tp].dim
    part_shape = list(t.shape)
    part_shape[dim] //= mesh.size(tp)
    sizes = _chunk_sizes(part_shape[dim], mesh.size(shard))
    local = t.to_local().contiguous()
    padded = torch.zeros(
        [max(sizes) if i == dim else n for i, n in enumerate(local.shape)],
        dtype=local.dtype,
        device=local.device,
    )
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=mesh.get_group(shard))
    part = torch.cat([g.narrow(dim, 0, n) for g, n in zip(gathered, sizes, strict=True)], dim)
    tp_mesh = mesh[TENSOR_PARALLEL]
    whole = DTensor.from_local(
        part, tp_mesh, [t.placements[tp]], run_check=False, shape=t.shape, stride=t.stride()
    )
    return whole.full_tensor()


def local_part(t: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` as `t` places it, with no communication: a view at its
    offsets for plain shards; for chunk-by-chunk ones, a copy of only this rank's
    elements, picked by index along each split dimension.

    Why by index: DTensor's own local split of a chunk-by-chunk layout (distribute_tensor
    with _StridedShard) makes every rank's chunk before it keeps one, a second copy of
    the full tensor. Measured on the meta build under fsdp=2,tp=2 (GPT, 16 MiB
    embedding): that copy was the build's peak, 76.1 MiB a rank against a target of
    57.4. The indices are the same split applied to an arange, so the rank's elements
    are the ones DTensor would keep (tested against it in test_placements.py)."""
    if _nested(t) is None and not chunk_by_chunk(t):
        return full[local_window(t)]
    part = full
    for dim in sorted({p.dim for p in t.placements if _shard(p)}):
        part = part.index_select(dim, _local_indices(t, dim, full.device))
    return part


def _local_indices(t: DTensor, dim: int, device: torch.device) -> torch.Tensor:
    """The indices along tensor dimension `dim` of the elements this rank keeps of `t`."""
    length = t.shape[dim]
    dims = _nested(t)
    if dims is not None and t.placements[dims[0]].dim == dim:  # see full_tensor
        tp, shard = dims
        mesh = t.device_mesh
        tp_part = _split_indices(length, mesh[TENSOR_PARALLEL], [t.placements[tp]], dim)
        chunks = tp_part.chunk(mesh.size(shard))
        index = mesh.get_local_rank(shard)
        indices = chunks[index] if index < len(chunks) else tp_part[:0]
    else:
        placements = [p if _shard(p) and p.dim == dim else Replicate() for p in t.placements]
        indices = _split_indices(length, t.device_mesh, placements, dim)
    return indices.to(device)


def _split_indices(length: int, mesh: DeviceMesh, placements: list, dim: int = 0) -> torch.Tensor:
    """This rank's local part of arange(length) laid along tensor dimension `dim`, split
    by `placements` on `mesh` (DTensor's own split: no communication)."""
    shape = [1] * (dim + 1)
    shape[dim] = length
    arange = torch.arange(length).reshape(shape)
    local = distribute_tensor(arange, mesh, placements, src_data_rank=None).to_local()
    return local.reshape(-1)


def chunk_by_chunk(t: DTensor) -> bool:
    """Whether a placement of `t` splits it chunk by chunk: its local part is then no
    one window of the full tensor."""
    return any(_strided(p) for p in t.placements)


def local_window(t: DTensor) -> tuple[slice, ...]:
    """The slices of the full tensor that `t`'s local shard holds (plain shards only:
    see chunk_by_chunk)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _chunk_sizes(length: int, parts: int) -> list[int]:
    """torch.chunk's sizes of `length` in `parts` (FSDP2's shards; zeros past the last)."""
    sizes = [c.numel() for c in torch.empty(length).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))
