"""fit(..., loggers=["wandb"], log_dir=...): every record to a Weights & Biases run,
through the `wandb` library (the `meshfit[wandb]` extra), from rank 0.

Online when W&B has a login here (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc),
else offline: the run is written under <log_dir>/wandb/ with no network and `wandb sync`
uploads it later. WANDB_MODE, or `mf.WandbLogger(log_dir, mode=...)`, decides instead.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from meshfit.errors import MeshfitError
from meshfit.training.callbacks import Callback, _flat

if TYPE_CHECKING:
    from meshfit.engine import Engine

MISSING = (
    "loggers=['wandb'] needs the wandb package: pip install meshfit[wandb] (or pip install wandb)"
)


class WandbLogger(Callback):
    """A W&B run in `log_dir` (its `wandb/` folder) holding every record at its step:
    loss, eval_loss, metrics, lr (and LearningRateMonitor's fields), samples/s,
    tokens/s, memory. The run's config holds the plan, the world size and the optimizer
    settings, plus your `config`. Other keywords go to wandb.init (entity, tags, ...)."""

    def __init__(
        self,
        log_dir: str,
        project: str = "meshfit",
        name: str | None = None,
        mode: str | None = None,
        config: dict[str, Any] | None = None,
        **init_options: Any,
    ) -> None:
        # checked on every rank, before any work: rank 0 alone failing would leave the
        # others waiting in the first collective
        if importlib.util.find_spec("wandb") is None:
            raise MeshfitError(MISSING)
        self.log_dir = str(log_dir)
        self.project, self.name, self.mode = project, name, mode
        self.config = dict(config or {})
        self.init_options = init_options
        self.run: Any = None

    def on_train_begin(self, engine: Engine, checkpoint_dir: str | None) -> None:
        if engine.rank != 0:
            return
        try:
            import wandb
        except ImportError:
            raise MeshfitError(MISSING) from None
        os.makedirs(self.log_dir, exist_ok=True)
        config = {
            "plan": str(engine.plan),
            "world_size": engine.world_size,
            "optimizer": type(engine.optimizer).__name__,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params" and _plain(v)}
                for g in engine.optimizer.param_groups
            ],
            **self.config,
        }
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            dir=self.log_dir,
            mode=self.mode or _default_mode(),
            config=config,
            **self.init_options,
        )

    def on_log(self, record: dict[str, Any], engine: Engine) -> None:
        self._write(record)

    def on_eval_end(self, record: dict[str, Any], engine: Engine) -> bool | None:
        # the step's record again, now with eval_loss: W&B merges it into that step
        self._write(record)
        return None

    def on_train_end(self, history: Any) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def _write(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        values = {
            k: v
            for k, v in _flat(record).items()
            if k not in ("step", "time") and isinstance(v, (int, float))
        }
        self.run.log(values, step=record["step"])


def _default_mode() -> str:
    """WANDB_MODE if set; online with a W&B login here, else offline (no network)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        logged_in = netrc.netrc().authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool, type(None), tuple, list))
