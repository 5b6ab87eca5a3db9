"""Keras-style control of `fit`: callbacks that see every record and can stop the run,
and loggers that write the records where people read them.

A `Callback`'s hooks run on every rank, with the same records there (losses and eval
losses are global values), so every rank takes the same decision. A hook that returns
True stops the run after the current step: `fit` then saves a checkpoint of that step
(with a checkpoint_dir) and returns its History, whose `stopped` says why. Plain
functions `fn(step, engine)` still work as before.

Asking for every step's record costs one device sync per step (fit otherwise reads
losses once per `log_every` steps): only callbacks that define `on_step_end` ask.
"""

from __future__ import annotations

import csv
import math
import os
from typing import TYPE_CHECKING, Any

from meshfit.errors import MeshfitError

if TYPE_CHECKING:
    from meshfit.engine import Engine


class Callback:
    """Override the hooks you need; each gets the record (a dict: step, loss, lr, time,
    eval_loss, samples_per_s, tokens_per_s, memory where measured) and the engine.
    Return True from on_step_end / on_eval_end to stop training after this step."""

    stop_reason: str | None = None  # set it with the True return: History.stopped says it
    # the record field it watches (fit refuses, at start, one that the run never computes)
    monitor: str | None = None
    # whether it acts on each evaluation during training (one at the end is too late)
    needs_evaluations_during_training: bool = False

    def on_train_begin(self, engine: Engine, checkpoint_dir: str | None) -> None:
        """Before the first step (after a resume, at the resumed step)."""

    def on_step_begin(self, step: int, engine: Engine) -> dict[str, float] | None:
        """Before training step `step` (numbered from 1): fields to add to that step's
        record, e.g. the settings it trains with. Read host-side values here (no device
        sync): the record itself is made at the next log."""
        return None

    def on_step_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        """After every step, with its record (one device sync per step: see the module
        doc; `on_log` costs nothing extra)."""
        return None

    def on_log(self, record: dict[str, Any], engine: Engine) -> None:
        """For each record as fit reads it from the device: every `log_every` steps,
        the records of the steps since the last."""

    def on_eval_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        """After each evaluation, with the record of its step (holding eval_loss)."""
        return None

    def on_train_end(self, history: Any) -> None:
        """After the last step, with the History fit returns."""


def wants_every_step(callback: Callback) -> bool:
    return type(callback).on_step_end is not Callback.on_step_end


def adds_fields(callback: Callback) -> bool:
    return type(callback).on_step_begin is not Callback.on_step_begin


class _Monitor:
    """The best value of a record field so far."""

    def __init__(self, monitor: str, mode: str, min_delta: float) -> None:
        if mode not in ("min", "max"):
            raise MeshfitError(f"mode must be 'min' or 'max', not {mode!r}")
        if not isinstance(monitor, str):
            raise MeshfitError(
                f"monitor must be a record field name, e.g. 'eval_loss', not {monitor!r}"
            )
        self.monitor, self.mode, self.min_delta = monitor, mode, float(min_delta)
        self.best: float | None = None
        self.best_step: int | None = None

    def improved(self, record: dict[str, Any]) -> bool | None:
        """True / False for a record holding the field; None for one without it."""
        value = record.get(self.monitor)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        better = self.best is None or (
            value < self.best - self.min_delta
            if self.mode == "min"
            else value > self.best + self.min_delta
        )
        if better:
            self.best, self.best_step = float(value), record["step"]
        return better


class EarlyStopping(Callback):
    """Stop when `monitor` (default "eval_loss"; "loss" works too) has not improved by
    more than `min_delta` for `patience` checks in a row (evaluations for eval_loss,
    steps otherwise)."""

    def __init__(
        self,
        monitor: str = "eval_loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "min",
    ) -> None:
        if not isinstance(patience, int) or patience < 1:
            raise MeshfitError(f"patience must be a whole number >= 1, not {patience!r}")
        self._watch = _Monitor(monitor, mode, min_delta)
        self.monitor = monitor
        self.patience = patience
        self.waited = 0

    needs_evaluations_during_training = True  # to stop a run early

    def on_step_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        return self._check(record) if self._watch.monitor != "eval_loss" else None

    def on_eval_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        return self._check(record) if self._watch.monitor == "eval_loss" else None

    def _check(self, record: dict[str, Any]) -> bool | None:
        improved = self._watch.improved(record)
        if improved is None:
            return None
        self.waited = 0 if improved else self.waited + 1
        if self.waited >= self.patience:
            self.stop_reason = (
                f"early stopping: {self._watch.monitor} did not improve for {self.patience} "
                f"checks (best {self._watch.best:.6g} at step {self._watch.best_step})"
            )
            return True
        return None


class BestCheckpoint(Callback):
    """Keep a checkpoint of the best step by `monitor` at `path` (default
    <checkpoint_dir>/best), replaced whenever the monitor improves. It loads with
    engine.load under any plan."""

    def __init__(
        self, monitor: str = "eval_loss", path: str | None = None, mode: str = "min"
    ) -> None:
        self._watch = _Monitor(monitor, mode, 0.0)
        self.monitor = monitor
        self.path = path

    def on_train_begin(self, engine: Engine, checkpoint_dir: str | None) -> None:
        if self.path is None:
            if checkpoint_dir is None:
                raise MeshfitError(
                    "BestCheckpoint needs a place: fit(..., checkpoint_dir=...) (it keeps "
                    "<checkpoint_dir>/best), or BestCheckpoint(path=...)"
                )
            self.path = os.path.join(checkpoint_dir, "best")

    def on_step_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        if self._watch.monitor != "eval_loss":
            self._keep(record, engine)
        return None

    def on_eval_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        if self._watch.monitor == "eval_loss":
            self._keep(record, engine)
        return None

    def _keep(self, record: dict[str, Any], engine: Engine) -> None:
        if self._watch.improved(record):  # the same on every rank: a collective save
            engine.save(
                self.path,
                extra={"best": {self._watch.monitor: self._watch.best, "step": record["step"]}},
            )


class LearningRateMonitor(Callback):
    """Every parameter group's learning rate, as the step trains with it, in each
    record (so in History, history.jsonl and every logger).

    fit's records always carry "lr", the first group's rate. With several groups this
    adds "lr/<name>" for each (the group's "name" key, else group0, group1, ...).
    momentum=True adds "momentum" (SGD's momentum, Adam's beta1) and weight_decay=True
    "weight_decay", per group ("momentum/<name>") when there are several."""

    def __init__(self, momentum: bool = False, weight_decay: bool = False) -> None:
        self.momentum, self.weight_decay = bool(momentum), bool(weight_decay)

    def on_step_begin(self, step: int, engine: Engine) -> dict[str, float] | None:
        groups = engine.optimizer.param_groups
        names = _group_names(groups)
        fields: dict[str, float] = {}
        for name, group in zip(names, groups, strict=True):
            suffix = f"/{name}" if len(groups) > 1 else ""
            if suffix:  # one group: fit's own "lr" is it
                fields[f"lr{suffix}"] = _number(group["lr"])
            if self.momentum and _momentum(group) is not None:
                fields[f"momentum{suffix}"] = _momentum(group)
            if self.weight_decay and "weight_decay" in group:
                fields[f"weight_decay{suffix}"] = _number(group["weight_decay"])
        return fields


def _group_names(groups: list[dict[str, Any]]) -> list[str]:
    """Each group's "name" when every group has a distinct one, else group0, group1..."""
    names = [g.get("name") for g in groups]
    if all(isinstance(n, str) and n and "/" not in n for n in names) and len(set(names)) == len(
        names
    ):
        return names
    return [f"group{i}" for i in range(len(groups))]


def _momentum(group: dict[str, Any]) -> float | None:
    if "betas" in group:  # Adam, AdamW, ...: beta1 plays momentum's part
        return _number(group["betas"][0])
    if "momentum" in group:
        return _number(group["momentum"])
    return None


def _number(value: Any) -> float:
    # a tensor lr (capturable / fused optimizers) lives on the CPU: no device sync
    return float(value.item()) if hasattr(value, "item") else float(value)


# ---- loggers ------------------------------------------------------------------------
class CSVLogger(Callback):
    """`<log_dir>/metrics.csv`: one row per logged step, a column per field (written by
    rank 0, rewritten when a new field appears, e.g. the first eval_loss)."""

    def __init__(self, log_dir: str) -> None:
        self.path = os.path.join(log_dir, "metrics.csv")
        self.rows: dict[int, dict[str, Any]] = {}
        self.engine: Engine = None

    def on_train_begin(self, engine: Engine, checkpoint_dir: str | None) -> None:
        self.engine = engine

    def on_log(self, record: dict[str, Any], engine: Engine) -> None:
        self.rows[record["step"]] = _flat(record)
        self._write()

    def on_eval_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        self.on_log(record, engine)
        return None

    def on_train_end(self, history: Any) -> None:
        for record in history.records:
            self.rows[record["step"]] = _flat(record)
        self._write()

    def _write(self) -> None:
        if self.engine is None or self.engine.rank != 0:
            return
        columns = list(dict.fromkeys(k for row in self.rows.values() for k in row))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows[s] for s in sorted(self.rows))


class TensorBoardLogger(Callback):
    """Event files in `log_dir` that `tensorboard --logdir` shows: every numeric field
    of every record (loss, eval_loss, lr, samples_per_s, tokens_per_s, memory) at its
    step, through TensorBoard's own SummaryWriter (rank 0)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.writer: Any = None
        self.written: set[tuple[int, str]] = set()

    def on_train_begin(self, engine: Engine, checkpoint_dir: str | None) -> None:
        if engine.rank != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MeshfitError(
                "loggers=['tensorboard'] needs the tensorboard package: pip install tensorboard "
                "(or meshfit[loggers])"
            ) from None
        self.writer = SummaryWriter(self.log_dir)

    def on_log(self, record: dict[str, Any], engine: Engine) -> None:
        self._write(record)

    def on_eval_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        self._write(record)
        return None

    def on_train_end(self, history: Any) -> None:
        if self.writer is not None:
            for record in history.records:
                self._write(record)
            self.writer.close()

    def _write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in _flat(record).items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            if (record["step"], key) not in self.written:
                self.written.add((record["step"], key))
                self.writer.add_scalar(key, value, record["step"])


def _flat(record: dict[str, Any]) -> dict[str, Any]:
    """A record with nested dicts (memory) flattened to "memory/params" keys."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out
