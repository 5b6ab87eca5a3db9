"""How fit turns a dataset's samples into batches: the collate that stacks (or pads)
them, and, for samples that are dicts of columns (a Hugging Face dataset's rows), which
columns are the inputs and which the targets."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import default_collate

from meshfit.errors import MeshfitError


@dataclass(frozen=True)
class Reading:
    collate: Callable[[list[Any]], Any] | None = None
    inputs: str | Sequence[str] | None = None  # column(s) the model takes
    targets: str | None = None  # the column the loss compares with

    def __post_init__(self) -> None:
        if self.collate is not None and not callable(self.collate):
            raise MeshfitError(
                f"collate must be a function from a list of samples to a batch (e.g. a "
                f"transformers data collator), not {self.collate!r}"
            )
        if (self.inputs is None) != (self.targets is None):
            raise MeshfitError(
                "give inputs= and targets= together (the columns the model takes and the "
                "one the loss compares with), e.g. inputs='input_ids', targets='labels'"
            )
        if self.inputs is not None and not (
            isinstance(self.inputs, str)
            or (isinstance(self.inputs, Sequence) and all(isinstance(c, str) for c in self.inputs))
        ):
            raise MeshfitError(
                f"inputs must be a column name or a list of them, not {self.inputs!r}"
            )
        if self.targets is not None and not isinstance(self.targets, str):
            raise MeshfitError(f"targets must be a column name, not {self.targets!r}")

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return self.collate or default_collate

    def pick(self, batch: Any) -> Any:
        """The batch as (inputs, targets) when columns are named; else as it is."""
        if self.inputs is None:
            return batch
        if not isinstance(batch, Mapping):
            raise MeshfitError(
                f"inputs= and targets= name columns, but a batch is a "
                f"{type(batch).__name__}, not a dict of columns"
            )
        wanted = [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)
        missing = [c for c in [*wanted, self.targets] if c not in batch]
        if missing:
            raise MeshfitError(f"the batch has no column(s) {missing}; it has {sorted(batch)}")
        inputs = (
            batch[self.inputs] if isinstance(self.inputs, str) else {c: batch[c] for c in wanted}
        )
        return inputs, batch[self.targets]
