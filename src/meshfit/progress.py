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

    def __init__(self, total_steps: int, start_step: int, *, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total_steps
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
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        if log_line:
            done = step - self._start_step
            elapsed = time.perf_counter() - self._start_time
            eta = elapsed / done * (self.total - step) if done else 0.0
            self.console.print(
                f"step {step:>{len(str(self.total))}}/{self.total} | {status} | eta {format_duration(eta)}"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
