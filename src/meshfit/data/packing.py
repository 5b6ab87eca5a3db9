"""Documents packed into rows of one length (`mf.data.pack`): no padding spent, and every
document attends only to itself.

Each row holds whole documents back to back (a document longer than a row is cut into
row-long pieces); `position_ids` restart at 0 at each document, which is how transformers
reads packed rows (its masks keep attention within a document when the positions
restart and no cache is kept: meshfit passes `use_cache=False` to a transformers model
whose batch holds position_ids), and how meshfit's context parallel reads them. `labels`
are the tokens (transformers shifts them) with -100 at each document's first token, so no
token is predicted from the previous document, and on the padding at a row's end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from meshfit.errors import MeshfitError


def pack(
    documents: Iterable[Sequence[int] | torch.Tensor],
    length: int,
    *,
    pad_id: int = 0,
    flash_attention_kwargs: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Samples of `length` tokens, each a dict with input_ids, position_ids and labels
    (and, with `flash_attention_kwargs`, cu_seq_lens_q/k and max_length_q/k: what
    transformers' flash-attention kernels take for a packed row), documents in order,
    whole where they fit. Give the list to `mf.fit` (or stack rows for engine.step) with
    `loss_fn="model"` or `mf.losses.cross_entropy(shift=True)`."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 2:
        raise MeshfitError(f"pack needs a row length of at least 2 tokens, not {length!r}")
    rows: list[dict[str, torch.Tensor]] = []
    ids: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    starts: list[int] = []

    def close() -> None:
        if not ids:
            return
        pad = length - len(ids)
        row = {
            "input_ids": torch.tensor(ids + [pad_id] * pad),
            "position_ids": torch.tensor(positions + list(range(pad))),
            "labels": torch.tensor(labels + [-100] * pad),
        }
        if flash_attention_kwargs:
            bounds = [*starts, len(ids)] + ([length] if pad else [])
            cu = torch.tensor(bounds, dtype=torch.int32)
            row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = cu
            longest = int((cu[1:] - cu[:-1]).max())
            row["max_length_q"] = row["max_length_k"] = torch.tensor(longest)
        rows.append(row)
        ids.clear()
        positions.clear()
        labels.clear()
        starts.clear()

    for document in documents:
        tokens = [int(t) for t in (document.tolist() if torch.is_tensor(document) else document)]
        while tokens:
            if len(ids) == length:
                close()
            room = length - len(ids)
            if len(tokens) > room and ids:  # a document starts on a row of its own when it can
                close()
                room = length
            piece, tokens = tokens[:room], tokens[room:]
            starts.append(len(ids))
            ids.extend(piece)
            positions.extend(range(len(piece)))
            labels.extend([-100, *piece[1:]])
    close()
    return rows


def stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Rows of `pack` as one batch (a dict of stacked tensors), as a collator gives it."""
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
