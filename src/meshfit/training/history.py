"""What a run recorded: the History fit returns, and the JSONL file rank 0 writes it to
(rewritten on resume up to the checkpoint's step).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from meshfit.engine import Engine


@dataclass
class History:
    """What a `fit` run recorded: one dict per step ("step", "loss", "lr" (the first
    parameter group's, as the step trained with it), "time", and
    "eval_loss" / "samples_per_s" / "tokens_per_s" on the steps where they were measured)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    engine: Engine | None = None  # the engine that trained (its model, rank, device)
    stopped: str | None = None  # why a callback stopped the run early, if one did
    # plan="auto": the plan chosen, its predicted step time and memory, and the measured
    planned: dict[str, Any] | None = None
    # Each resume into another world size (an elastic run's lost or joined node): the
    # step resumed from, "world" and "plan" (before, after), "redone" (steps trained again;
    # None where the run was not elastic and did not record them)
    world_changes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        return [(r["step"], r["eval_loss"]) for r in self.records if "eval_loss" in r]

    @property
    def final_loss(self) -> float | None:
        return self.records[-1]["loss"] if self.records else None

    def plot(self, path: str = "history.png", title: str | None = None) -> str:
        """Write the run's curves (loss, eval loss, metrics, lr) as a PNG (matplotlib)."""
        from meshfit.training.plot import plot_records

        return plot_records(self.records, path, title)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)


class HistoryFile:
    """The run's records as JSON lines. Every rank reads it on resume; only the writer
    (rank 0) writes it. No path: nothing is read or written."""

    def __init__(self, path: str | None, writer: bool) -> None:
        self.path = path
        self.writer = writer and bool(path)
        self._written = 0  # how many of the run's records the file holds

    @classmethod
    def of_run(cls, path: str | None, checkpoint_dir: str | None, writer: bool) -> HistoryFile:
        """`path`, or <checkpoint_dir>/history.jsonl when there is a checkpoint_dir."""
        if not path and checkpoint_dir:
            path = os.path.join(checkpoint_dir, "history.jsonl")
        return cls(path, writer)

    def read(self, up_to_step: int) -> list[dict[str, Any]]:
        """The records of steps up to `up_to_step` ([] when there is no file)."""
        if not self.path or not os.path.isfile(self.path):
            return []
        records = []
        with open(self.path) as f:
            for line in f:
                line = line.strip()
                if line:
                    record = json.loads(line)
                    if record["step"] <= up_to_step:
                        records.append(record)
        return records

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file with `records` (atomically)."""
        self._written = len(records)
        if not self.writer:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def append_new(self, records: list[dict[str, Any]]) -> None:
        """Append the records added to `records` since the last write."""
        new, self._written = records[self._written :], len(records)
        if not self.writer or not new:
            return
        with open(self.path, "a") as f:
            for record in new:
                f.write(json.dumps(record) + "\n")
