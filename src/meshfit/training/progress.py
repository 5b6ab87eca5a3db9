"""What `fit` shows while it trains: a live bar on a terminal, plain lines elsewhere.
Only rank 0 shows anything."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


class TrainingDisplay:
    """Progress of a training run. `enabled=False` (other ranks) makes it silent."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        *,
        enabled: bool,
        epochs: int | None = None,
        steps_per_epoch: int = 0,
    ) -> None:
        self.enabled = enabled
        self.total = total_steps
        # Trained by epochs (Keras' habit): lines say "epoch 2/10", and each epoch
        # starts with an "Epoch 2/10" line.
        self.epochs = epochs if epochs and steps_per_epoch else None
        self.steps_per_epoch = steps_per_epoch
        self._epoch_shown = (start_step // steps_per_epoch) if self.epochs else 0
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self._bar: Progress | None = None
        self._task = None
        if enabled and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._task = self._bar.add_task(
                "train", total=total_steps, completed=start_step, status=""
            )
            self._bar.start()
        self._start_time = time.perf_counter()
        self._start_step = start_step

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text)

    def update(self, step: int, status: str, log_line: bool) -> None:
        """Advance to `step`; print `status` as a line when `log_line` (or no bar)."""
        if not self.enabled:
            return
        where = ""
        if self.epochs:
            epoch = (step - 1) // self.steps_per_epoch + 1
            if epoch > self._epoch_shown:
                self._epoch_shown = epoch
                self.console.print(f"Epoch {epoch}/{self.epochs}")
            where = f"epoch {epoch}/{self.epochs} | "
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=where + status)
        if log_line:
            done = step - self._start_step
            elapsed = time.perf_counter() - self._start_time
            eta = elapsed / done * (self.total - step) if done else 0.0
            self.console.print(
                f"{where}step {step:>{len(str(self.total))}}/{self.total} | {status} | "
                f"eta {format_duration(eta)}"
            )

    def epoch_ending(self, step: int) -> tuple[str | None, int]:
        """("epoch 3/10", steps per epoch) when `step` ends an epoch of a run trained by
        epochs, else (None, 0)."""
        if not self.epochs or step % self.steps_per_epoch:
            return None, 0
        return f"epoch {step // self.steps_per_epoch}/{self.epochs}", self.steps_per_epoch

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
