"""The loggers `fit(loggers=[...], log_dir=...)` names: CSV and TensorBoard (callbacks.py)
and Weights & Biases (wandb_logger.py, its own module: wandb is an extra)."""

from __future__ import annotations

from typing import Any

from meshfit.errors import MeshfitError
from meshfit.training.callbacks import Callback, CSVLogger, TensorBoardLogger


def _wandb(log_dir: str) -> Callback:
    from meshfit.training.wandb_logger import WandbLogger  # its own module: wandb is an extra

    return WandbLogger(log_dir)


LOGGERS = {"csv": CSVLogger, "tensorboard": TensorBoardLogger, "wandb": _wandb}


def make_loggers(names: Any, log_dir: str | None) -> list[Callback]:
    """The loggers `fit(loggers=[...], log_dir=...)` names."""
    if not names:
        return []
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise MeshfitError(f"loggers must be a list of names from {sorted(LOGGERS)}, not {names!r}")
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise MeshfitError(f"unknown logger(s) {unknown}; meshfit has {sorted(LOGGERS)}")
    if not log_dir:
        raise MeshfitError("loggers need a directory: fit(..., loggers=[...], log_dir='runs/x')")
    return [LOGGERS[name](str(log_dir)) for name in names]
