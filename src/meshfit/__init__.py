"""meshfit: train a PyTorch model on many devices through one small API."""

from meshfit.engine import Engine, parallelize
from meshfit.errors import MeshfitError
from meshfit.launch import WorkerError, launch
from meshfit.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "MeshfitError",
    "Plan",
    "WorkerError",
    "__version__",
    "launch",
    "parallelize",
]
