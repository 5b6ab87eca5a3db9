"""Every rank starts from the same weights: rank 0's.

Each worker builds its own copy of the model, and without `torch.manual_seed` before the
build each draws other initial weights. DDP copies rank 0's parameters to the others
when it wraps the model, so a dp run forgives the missing seed; FSDP2, tensor parallel
and the pipeline cut do not: fsdp would train a model stitched from every rank's shard of
its own draw, and tp ranks would hold different copies of the weights they replicate
(norms, layers kept whole), a run no single process trains (measured: nanoGPT under
tp=2 unseeded was refused by the split's gradient check, which blamed the split).

So before any form, each rank fingerprints its model (a fixed sample of every tensor's
elements, compared exactly: unequal draws differ everywhere, so a sample finds them at a
cost independent of the model's size), and where any rank's differs from rank 0's, rank 0
broadcasts its parameters and buffers, once, as DDP would have.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from meshfit.errors import MeshfitError

SAMPLES = 64  # elements per tensor in the fingerprint


def fingerprint(model: nn.Module) -> tuple[list[str], str]:
    """The model's tensors (name, shape, dtype of each parameter and buffer) and a digest
    of `SAMPLES` evenly spaced elements of each, exact: no float arithmetic."""
    digest = hashlib.blake2b(digest_size=16)
    structure = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        structure.append(f"{name} {tuple(tensor.shape)} {tensor.dtype}")
        try:
            flat = tensor.detach().reshape(-1)
            sample = flat[_evenly_spaced(flat.numel()).to(flat.device)].cpu().contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a layout without plain elements (sparse, ...)
            continue
    return structure, digest.hexdigest()


def _evenly_spaced(numel: int) -> torch.Tensor:
    """`SAMPLES` indices from 0 to numel - 1 (all of them when fewer), in integers: a
    float32 linspace rounded the last index of a 128,256 x 256 embedding (numel above
    2**24) to numel itself, and the fingerprint indexed past the end."""
    count = min(numel, SAMPLES)
    return torch.arange(count, dtype=torch.int64) * max(numel - 1, 0) // max(count - 1, 1)


def _refuse_other_models(structure: list[str]) -> None:
    """Every rank (all of them get here): name the first tensor where a rank's model
    differs from rank 0's, and refuse."""
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, structure)
    mine = every[0]
    for rank, theirs in enumerate(every):
        if theirs != mine:
            first = next(
                (
                    f"{a!r} where rank 0 has {b!r}"
                    for a, b in zip(theirs, mine, strict=False)
                    if a != b
                ),
                f"{len(theirs)} tensors where rank 0 has {len(mine)}",
            )
            raise MeshfitError(
                f"the workers built different models: rank {rank}'s has {first}; every "
                f"worker must build the same model (the same code and config)"
            )


def start_from_rank0(model: nn.Module) -> bool:
    """Make every rank's parameters and buffers rank 0's where the ranks built different
    ones; True where they did (rank 0 then warns once)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    structure, values = fingerprint(model)
    shape_digest = hashlib.blake2b("\n".join(structure).encode(), digest_size=16).hexdigest()
    # digests only (32 bytes a rank): the whole list of names travels only to name a difference
    gathered: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (shape_digest, values))
    if any(shape != gathered[0][0] for shape, _ in gathered):
        _refuse_other_models(structure)
    prints = [digest for _, digest in gathered]
    if all(p == prints[0] for p in prints):
        return False
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            data = tensor.data
            sent = data if data.is_contiguous() and data.dtype != torch.bool else None
            if sent is None:  # gloo sends no bool; a strided tensor goes through a copy
                sent = (
                    data.contiguous().view(torch.uint8)
                    if data.dtype == torch.bool
                    else data.contiguous()
                )
            dist.broadcast(sent, src=0)
            if sent is not data:
                data.copy_(sent.view(torch.bool) if data.dtype == torch.bool else sent)
    if dist.get_rank() == 0:
        differ = sum(p != prints[0] for p in prints)
        warnings.warn(
            f"meshfit: {differ} of {len(prints)} workers built other initial weights than "
            f"rank 0 (no torch.manual_seed before building the model?); every worker now "
            f"starts from rank 0's, as DDP does",
            UserWarning,
            stacklevel=3,
        )
    return True
