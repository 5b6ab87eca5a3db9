"""Data as people have it in memory: columns of samples, one row per sample.

`fit(model, (x, y))` takes the pair as tensors, numpy arrays or lists (Keras users'
habit), inputs as a dict of columns (a tokenizer's `{"input_ids": ..., "attention_mask":
...}`), or one dict of columns holding the labels too (for `loss_fn="model"`). Rows are
served as samples of the same form, so the default collate stacks them back into the
batch the model takes.

Floating-point numpy arrays and lists become torch's default float dtype (float32
unless changed), as Keras casts numpy float64 input to its float32 default: a model's
weights are float32 and a float64 batch would not multiply with them. Integer columns
(labels, token ids) keep int64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from meshfit.errors import MeshfitError

Column = torch.Tensor
Columns = Column | dict[str, Column]


class ColumnsDataset(Dataset):
    """Row i of each column, in the columns' own form (a tensor, a dict of tensors, or
    an (inputs, targets) pair of those)."""

    def __init__(self, columns: Any, size: int) -> None:
        self.columns = columns
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        return _row(self.columns, index)


def as_columns(data: Any, what: str) -> ColumnsDataset | None:
    """A ColumnsDataset for an (inputs, targets) pair or a dict of columns; None for
    anything else (a Dataset, say)."""
    if isinstance(data, Mapping) and not isinstance(data, Dataset):
        columns = _columns(data, what)
        return ColumnsDataset(columns, _rows(columns, what))
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(_is_column(d) for d in data):
        columns = (_columns(data[0], what), _columns(data[1], what))
        return ColumnsDataset(columns, _rows(columns, what))
    return None


def _is_column(value: Any) -> bool:
    """Whether `value` is one column (a tensor, an array, a list of numbers) or a dict of
    them, rather than a sample."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim > 0
    if isinstance(value, Mapping):
        return bool(value) and all(_is_column(v) for v in value.values())
    if isinstance(value, list):
        # strings too: refused as a column with the fix, not counted as 2 samples
        return bool(value) and not isinstance(value[0], (Mapping, tuple))
    return False


def _columns(value: Any, what: str) -> Columns:
    if isinstance(value, Mapping):
        return {str(k): _column(v, f"{what}[{k!r}]") for k, v in value.items()}
    return _column(value, what)


def _column(value: Any, what: str) -> Column:
    if isinstance(value, torch.Tensor):
        return value
    try:
        array = np.asarray(value)
    except ValueError as error:  # ragged lists
        raise MeshfitError(
            f"{what} cannot be one column: {error}; give rows of one length (pad them), "
            f"or a Dataset with a collate"
        ) from None
    if array.dtype == object or array.dtype.kind in "USV":
        raise MeshfitError(
            f"{what} holds {array.dtype} values, not numbers; tokenize text first (give "
            f"token ids), or give a Dataset"
        )
    tensor = torch.as_tensor(array)
    if tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    elif tensor.dtype != torch.bool:
        tensor = tensor.long()
    return tensor


def _rows(columns: Any, what: str) -> int:
    leaves = _leaves(columns)
    sizes = {t.shape[0] if t.ndim else -1 for t in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise MeshfitError(
            f"{what}'s columns must have one row per sample, the same number in each; "
            f"got first dimensions {sorted(t.shape[0] if t.ndim else 0 for t in leaves)}"
        )
    return sizes.pop()


def _leaves(columns: Any) -> list[torch.Tensor]:
    if isinstance(columns, torch.Tensor):
        return [columns]
    if isinstance(columns, dict):
        return list(columns.values())
    return [leaf for part in columns for leaf in _leaves(part)]


def _row(columns: Any, index: int) -> Any:
    if isinstance(columns, torch.Tensor):
        return columns[index]
    if isinstance(columns, dict):
        return {k: v[index] for k, v in columns.items()}
    return tuple(_row(part, index) for part in columns)
