"""meshfit: train a PyTorch model on many devices through one small API."""

from meshfit import _worker_errors, losses, metrics
from meshfit.callbacks import (
    BestCheckpoint,
    Callback,
    CSVLogger,
    EarlyStopping,
    LearningRateMonitor,
    TensorBoardLogger,
)
from meshfit.engine import Engine, parallelize
from meshfit.errors import MeshfitError
from meshfit.fit import History, fit
from meshfit.inference import predict
from meshfit.launch import WorkerError, launch
from meshfit.placement import place
from meshfit.plan import Plan
from meshfit.planner import estimate, plan_search
from meshfit.verify import VerifyReport, verify
from meshfit.wandb_logger import WandbLogger

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
    "estimate",
    "fit",
    "launch",
    "losses",
    "metrics",
    "parallelize",
    "place",
    "plan_search",
    "predict",
    "verify",
]
