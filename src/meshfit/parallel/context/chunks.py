"""Which tokens of a sequence a context-parallel rank holds, and the batch cut so.

Causal attention costs a token in proportion to its position, so a rank holding one
contiguous slice of the sequence would do far more work at the end than at the start.
Each sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp - 1 - r (one
early, one late): every rank attends over the same number of keys (Megatron-LM's and
torchtitan's load balance).
"""

from __future__ import annotations

from typing import Any

import torch

from meshfit.errors import MeshfitError
from meshfit.trees import map_tensors


def local_positions(length: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The positions (0 .. length-1) of the tokens rank `rank` of `cp` holds, in the
    order it holds them: chunk `rank`, then chunk 2cp - 1 - rank."""
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def check_length(length: int, cp: int) -> None:
    if length % (2 * cp):
        raise MeshfitError(
            f"context parallel cuts each sequence into 2 x cp = {2 * cp} chunks, and a "
            f"sequence of {length} tokens does not divide into them; use a sequence length "
            f"that is a multiple of {2 * cp} (pad, or pack documents into rows of that "
            f"length: mf.data.pack), or another cp"
        )


def cut(tree: Any, length: int, positions: torch.Tensor) -> Any:
    """Every tensor of `tree` whose second dimension is the sequence (`length` long),
    cut to the rank's `positions`; the others as they are."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.ndim >= 2 and t.shape[1] == length:
            return t.index_select(1, positions.to(t.device))
        return t

    return map_tensors(tree, keep)


def shifted(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets made before the sequence is cut (the label at a chunk's edge
    belongs to the chunk that predicts it): position t holds labels[t + 1], the last
    position `ignore_index`."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Which document each token of a packed row belongs to: a new one wherever the
    positions restart (do not go up by one), as transformers reads packed rows."""
    restarts = torch.ones_like(position_ids, dtype=torch.bool)
    restarts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return restarts.long().cumsum(1)
