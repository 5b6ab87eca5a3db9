"""meshfit: train a PyTorch model on many devices through one small API."""

from typing import Any

from meshfit import data, losses, metrics
from meshfit.coupling import batch_sum, gather_batch
from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.fit import History, fit
from meshfit.inference import predict
from meshfit.launch import WorkerError, launch
from meshfit.launch import worker_errors as _worker_errors
from meshfit.parallel.placement import place
from meshfit.plan import Plan
from meshfit.prepare import parallelize
from meshfit.training.callbacks import (
    BestCheckpoint,
    Callback,
    CSVLogger,
    EarlyStopping,
    LearningRateMonitor,
    TensorBoardLogger,
)
from meshfit.training.wandb_logger import WandbLogger
from meshfit.verification.run import VerifyReport, verify

__version__ = "0.1.0"

_worker_errors.install()

__all__ = [
    "BestCheckpoint",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "Engine",
    "History",
    "LearningRateMonitor",
    "MeshfitError",
    "Plan",
    "TensorBoardLogger",
    "VerifyReport",
    "WandbLogger",
    "WorkerError",
    "__version__",
    "batch_sum",
    "data",
    "estimate",
    "fit",
    "gather_batch",
    "launch",
    "losses",
    "metrics",
    "parallelize",
    "place",
    "plan_search",
    "predict",
    "verify",
]


# The planner (mf.estimate, mf.plan_search, mf.planner) is imported on first use: it is
# not needed to train, and keeping it out of `import meshfit` keeps start-up fast.
_LAZY = {"estimate": "meshfit.planner", "plan_search": "meshfit.planner"}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "planner":
        return importlib.import_module("meshfit.planner")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "planner"})
