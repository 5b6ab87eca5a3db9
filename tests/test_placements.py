"""placements.local_part: the rank's elements of a full tensor, picked by index, equal
the local shard DTensor (or, for tp's chunk-by-chunk split sharded again by FSDP2, the
two steps placements.py describes) keeps, for every layout the plans make, on uneven
lengths too. Four gloo workers on a 2 x 2 mesh ("dp_shard", "tp")."""

from __future__ import annotations

import torch

import meshfit as mf


def _layouts_agree() -> list[list[str]]:
    """For each worker: the layouts whose local_part differs from the reference."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from meshfit.parallel.placements import local_part

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    tp_mesh = mesh["tp"]
    layouts = {  # name: (full shape, placements on (dp_shard, tp))
        "fsdp over plain tp, same dim": ((12, 6), [_StridedShard(0, split_factor=2), Shard(0)]),
        "fsdp dim 0, tp dim 1": ((12, 6), [Shard(0), Shard(1)]),
        "tp q|k|v chunk by chunk": ((12, 5), [Replicate(), _StridedShard(0, split_factor=3)]),
        "tp chunks on dim 1": ((5, 12), [Replicate(), _StridedShard(1, split_factor=3)]),
        "fsdp dim 1 over tp chunks": ((12, 6), [Shard(1), _StridedShard(0, split_factor=3)]),
        "uneven": ((10, 3), [_StridedShard(0, split_factor=2), Shard(0)]),
        "nested (fused bias, fsdp=2,tp=2)": ((12,), [Shard(0), _StridedShard(0, split_factor=3)]),
        "nested uneven": ((18, 2), [Shard(0), _StridedShard(0, split_factor=3)]),
    }
    wrong = []
    for name, (shape, placements) in layouts.items():
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        if name.startswith("nested"):
            # FSDP2's chunk of tp's part (see placements.py): the reference built by hand
            part = distribute_tensor(full, tp_mesh, [placements[1]], src_data_rank=None)
            chunks = part.to_local().chunk(2, placements[1].dim)
            index = mesh.get_local_rank("dp_shard")
            expected = chunks[index] if index < len(chunks) else None
            t = distribute_tensor(full, mesh, placements, src_data_rank=None)
        else:
            t = distribute_tensor(full, mesh, placements, src_data_rank=None)
            expected = t.to_local()
        got = local_part(t, full)
        if expected is None or not torch.equal(got, expected):
            wrong.append(name)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, wrong)
    return every


def test_local_part_picks_the_elements_each_layout_keeps() -> None:
    for rank, wrong in enumerate(mf.launch(_layouts_agree, nproc=4)):
        assert wrong == [], (rank, wrong)
