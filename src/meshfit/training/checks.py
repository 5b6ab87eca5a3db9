"""fit's arguments and the run's data, checked before anything starts: each refusal names
the fix.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from meshfit.errors import MeshfitError
from meshfit.training.callbacks import Callback as CallbackBase


def check_streams(
    train: Dataset, evaluation: Dataset | None, epochs: Any, eval_batches: Any, workers: Any
) -> None:
    """What a stream (an IterableDataset) cannot do, refused with the fix."""
    streams = [d for d in (train, evaluation) if isinstance(d, IterableDataset)]
    if not streams:
        return
    if isinstance(train, IterableDataset) and epochs is not None:
        raise MeshfitError(
            "dataset is an IterableDataset (a stream): it has no length to count epochs "
            "in; give max_steps=N"
        )
    if isinstance(evaluation, IterableDataset) and eval_batches is None:
        raise MeshfitError(
            "eval_dataset is an IterableDataset (a stream): say how many global batches an "
            "evaluation reads with eval_batches=N"
        )
    if workers:
        raise MeshfitError(
            "a stream (IterableDataset) is read with num_workers=0: each loader process "
            "would read the whole stream again"
        )


def check_monitors(
    callbacks: list[Any], eval_data: Any, eval_interval: int | None, metrics: Any
) -> None:
    """Refuse a callback that watches an evaluation value this run never computes, or
    one that acts on evaluations during training when the run evaluates only at its end
    (EarlyStopping could never stop it early)."""
    produced = {"eval_loss", *(f"eval_{name}" for name in (metrics or {}))}
    for callback in callbacks:
        watched = getattr(callback, "monitor", None)  # a plain function has none
        if not isinstance(watched, str) or not watched.startswith("eval_"):
            continue
        name = type(callback).__name__
        if eval_data is None:
            raise MeshfitError(
                f"{name} watches {watched!r}, which this run never computes: it has no "
                f"evaluation data; pass eval_dataset=... or validation_split=... (with "
                f"eval_every=N for evaluations during training), or watch 'loss'"
            )
        if watched not in produced:
            raise MeshfitError(
                f"{name} watches {watched!r}, which no evaluation computes (it gives "
                f"{', '.join(sorted(produced))}); watch one of those, or add the metric "
                f"with metrics={{{watched.removeprefix('eval_')!r}: fn}}"
            )
        if eval_interval is None and callback.needs_evaluations_during_training:
            raise MeshfitError(
                f"{name} watches {watched!r}, which this run evaluates only once, at its "
                f"end, so it could never act during training; pass eval_every=N (steps), "
                f"or train by epochs (evaluated at the end of each)"
            )


def check_args(
    batch_size: Any,
    max_steps: Any,
    epochs: Any,
    log_every: Any,
    checkpoint_every: Any,
    eval_every: Any,
) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise MeshfitError(f"batch_size must be a positive whole number, not {batch_size!r}")
    if (max_steps is None) == (epochs is None):
        raise MeshfitError("give fit either max_steps=N or epochs=N (exactly one of them)")
    counts = {
        "max_steps": max_steps,
        "epochs": epochs,
        "log_every": log_every,
        "checkpoint_every": checkpoint_every if isinstance(checkpoint_every, int) else None,
        "eval_every": eval_every,
    }
    checkpoint_interval(checkpoint_every)  # steps, or a time: refused here if neither
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise MeshfitError(f"{name} must be a positive whole number, not {value!r}")


def check_options(
    *,
    eval_batches: Any,
    keep_checkpoints: Any,
    seed: Any,
    num_workers: Any,
    history_file: Any,
    checkpoint_dir: Any,
    callbacks: Any,
    flags: dict[str, Any],
) -> None:
    """Refuse, before anything starts, the arguments that would otherwise fail (or
    quietly do something else) only later in the run."""

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if eval_batches is not None and not (whole(eval_batches) and eval_batches >= 1):
        raise MeshfitError(f"eval_batches must be a positive whole number, not {eval_batches!r}")
    if not (whole(keep_checkpoints) and keep_checkpoints >= 1):
        raise MeshfitError(
            f"keep_checkpoints must be a whole number >= 1 (how many checkpoints to keep), "
            f"not {keep_checkpoints!r}"
        )
    if not whole(seed):
        raise MeshfitError(f"seed must be a whole number, not {seed!r}")
    if not (whole(num_workers) and num_workers >= 0):
        raise MeshfitError(
            f"num_workers must be a whole number >= 0 (data-loading processes), not {num_workers!r}"
        )
    for name, path in (("history_file", history_file), ("checkpoint_dir", checkpoint_dir)):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise MeshfitError(f"{name} must be a path, not {path!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise MeshfitError(f"{name} must be True or False, not {value!r}")
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise MeshfitError(f"callbacks must be a list of functions, not {callbacks!r}")
    # The items of a list or tuple (another iterable is read once, by fit itself).
    for callback in callbacks if isinstance(callbacks, (list, tuple)) else ():
        if not callable(callback) and not isinstance(callback, CallbackBase):
            raise MeshfitError(
                f"callbacks must be mf.Callback objects or functions called as "
                f"fn(step, engine), not {callback!r}"
            )


def check_size(data: Dataset, batch_size: int, what: str) -> int:
    try:
        size = len(data)
    except TypeError:
        raise MeshfitError(f"{what} has no length; fit needs a map-style dataset") from None
    if size == 0:
        raise MeshfitError(f"{what} is empty; give it at least one batch ({batch_size}) of samples")
    if size < batch_size:
        raise MeshfitError(
            f"{what} holds {size} samples, fewer than one global batch of {batch_size}; "
            f"use a smaller batch_size or more data"
        )
    return size


_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


def checkpoint_interval(every: Any) -> tuple[int | None, float | None]:
    """(steps, seconds) of fit's checkpoint_every: a positive whole number of steps, or a
    time (a datetime.timedelta, or text such as "90s", "30min", "2h")."""
    if every is None:
        return None, None
    if isinstance(every, int) and not isinstance(every, bool):
        if every < 1:
            raise MeshfitError(f"checkpoint_every must be a positive whole number, not {every!r}")
        return every, None
    seconds = None
    if isinstance(every, datetime.timedelta):
        seconds = every.total_seconds()
    elif isinstance(every, str):
        text = every.strip().lower()
        for unit in sorted(_UNITS, key=len, reverse=True):
            number = text.removesuffix(unit).strip()
            if text.endswith(unit) and number.replace(".", "", 1).isdigit():
                seconds = float(number) * _UNITS[unit]
                break
    if seconds is None or seconds <= 0:
        raise MeshfitError(
            f"checkpoint_every must be a number of steps or a time such as '30min', "
            f"'2h', '90s' or a datetime.timedelta, not {every!r}"
        )
    return None, seconds
