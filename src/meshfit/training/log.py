"""Each step's record on its way out: the step log (loss, rates, memory, the log line, the
progress display) and the Callback hooks that see every record.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.launch import watchdog
from meshfit.training.callbacks import Callback as CallbackBase
from meshfit.training.callbacks import adds_fields, wants_every_step
from meshfit.training.history import History
from meshfit.training.progress import TrainingDisplay, format_duration, format_rate


class Hooks:
    """The run's Callback objects: each new record goes to on_log (and on_step_end),
    each evaluation to on_eval_end; a hook returning True stops the run."""

    def __init__(self, callbacks: list[CallbackBase], engine: Engine) -> None:
        self.callbacks = callbacks
        self.engine = engine
        self.every_step = any(wants_every_step(c) for c in callbacks)
        self.adding = [c for c in callbacks if adds_fields(c)]
        self.seen = 0  # records already handed out
        self.stop: str | None = None

    def begin(self, checkpoint_dir: str | None, seen: int) -> None:
        self.seen = seen  # a resumed run's earlier records are not handed out again
        for c in self.callbacks:
            c.on_train_begin(self.engine, checkpoint_dir)

    def step_fields(self, step: int) -> dict[str, Any]:
        """What the callbacks add to `step`'s record (on_step_begin)."""
        fields: dict[str, Any] = {}
        for c in self.adding:
            fields.update(c.on_step_begin(step, self.engine) or {})
        return fields

    def after_flush(self, records: list[dict[str, Any]]) -> None:
        for record in records[self.seen :]:
            for c in self.callbacks:
                c.on_log(record, self.engine)
                self._obey(c, c.on_step_end(record, self.engine))
        self.seen = len(records)

    def after_eval(self, record: dict[str, Any]) -> None:
        for c in self.callbacks:
            self._obey(c, c.on_eval_end(record, self.engine))

    def end(self, history: History) -> None:
        for c in self.callbacks:
            c.on_train_end(history)

    def _obey(self, callback: CallbackBase, answer: Any) -> None:
        if answer is True and self.stop is None:
            self.stop = callback.stop_reason or f"{type(callback).__name__} asked to stop"


class StepLog:
    """The run's metrics. Each step leaves its loss on the device; `flush` reads the
    pending ones in one sync per log interval into records (refusing a non-finite loss),
    adds samples/s, tokens/s (real tokens of token-id inputs, all ranks) and, if asked, memory to the last one,
    and updates the display."""

    def __init__(
        self,
        engine: Engine,
        display: TrainingDisplay,
        batch_size: int,
        report_memory: bool,
        records: list[dict[str, Any]],
        start_step: int,
    ) -> None:
        self.engine = engine
        self.display = display
        self.batch_size = batch_size
        self.report_memory = report_memory
        self.records = records
        # (step, loss, lr, metrics, callbacks' fields): read at the next flush
        self._pending: list[
            tuple[int, torch.Tensor, float, dict[str, torch.Tensor], dict[str, Any]]
        ] = []
        self._tokens: torch.Tensor | int | None = None  # this rank's real tokens since the last log
        self._last_time, self._last_step = time.perf_counter(), start_step
        self._start_time = time.perf_counter()
        # samples/s -> MFU, where the devices' peak is known (planner/mfu.py)
        self.mfu_of: Callable[[float], float] | None = None

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        lr: float,
        tokens: torch.Tensor | int | None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        """Keep a step's loss and real-token count (still on the device) until the next
        flush, with the host-side fields callbacks add to its record."""
        if tokens is not None:
            self._tokens = tokens if self._tokens is None else self._tokens + tokens
        self._pending.append((step, loss, lr, dict(self.engine.last_metrics), fields or {}))

    def flush(self, step: int, log_line: bool) -> None:
        """Read the pending losses into records and show the status at `step`."""
        if not self._pending:
            return
        with watchdog.phase("log", f"the log of step {step}", step=step):  # an all-reduce
            self._read_pending()
            self.display.update(step, self._measure(step), log_line=log_line)

    def add_eval(self, step: int, eval_loss: float, metrics: dict[str, float]) -> None:
        """Put `step`'s eval loss (and metrics) on its record and print them."""
        self.records[-1]["eval_loss"] = eval_loss
        self.records[-1].update(metrics)
        shown = "".join(f", {k.removeprefix('eval_')} {v:.4f}" for k, v in metrics.items())
        epoch, steps = self.display.epoch_ending(step)
        if epoch is None:
            self.display.print(f"step {step}: eval loss {eval_loss:.4f}{shown}")
            return
        # Keras' epoch line: the epoch's mean training loss beside the evaluation
        losses = [r["loss"] for r in self.records if step - steps < r["step"] <= step]
        mean = sum(losses) / len(losses)
        self.display.print(f"{epoch}: loss {mean:.4f} - eval loss {eval_loss:.4f}{shown}")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of the throughput."""
        paused = time.perf_counter()
        yield
        self._last_time += time.perf_counter() - paused

    def summarize(self, steps_done: int) -> None:
        """Print the run's closing line (when it trained at least one step)."""
        elapsed = time.perf_counter() - self._start_time
        if not self.records or steps_done <= 0:
            return
        last = self.records[-1]
        summary = (
            f"done: {steps_done} steps in {format_duration(elapsed)}, final loss {last['loss']:.4f}"
        )
        if "eval_loss" in last:
            summary += f", eval loss {last['eval_loss']:.4f}"
        self.display.print(summary)

    def _read_pending(self) -> None:
        # every pending loss and metric in one read from the device
        flat = [loss.double() for _, loss, *_ in self._pending]
        flat += [v for _, _, _, metrics, _ in self._pending for v in metrics.values()]
        read = torch.stack([t.reshape(()).to(flat[0].device) for t in flat]).tolist()
        values, rest = read[: len(self._pending)], iter(read[len(self._pending) :])
        for (step, _, lr, metrics, fields), value in zip(self._pending, values, strict=True):
            if not math.isfinite(value):
                raise MeshfitError(
                    f"the loss became {value} at step {step}; lower the learning rate, set "
                    f"grad_clip=1.0, or use precision='bf16' instead of 'fp16'"
                )
            elapsed = round(time.perf_counter() - self._start_time, 4)
            record = {"step": step, "loss": value, "lr": lr, "time": elapsed}
            record.update({name: next(rest) for name in metrics})
            record.update({k: v for k, v in fields.items() if k not in record})
            self.records.append(record)
        self._pending.clear()

    def _measure(self, step: int) -> str:
        """Add throughput (and memory) to the last record; returns the status text."""
        now = time.perf_counter()
        seconds = max(now - self._last_time, 1e-9)
        rate = (step - self._last_step) * self.batch_size / seconds
        self._last_time, self._last_step = now, step
        last = self.records[-1]
        last["samples_per_s"] = round(rate, 2)
        status = f"loss {last['loss']:.4f}"
        for name in self.engine.last_metrics:
            status += f" | {name} {last[name]:.4f}"
        status += f" | {format_rate(rate)} samples/s"
        if self.mfu_of is not None:
            last["mfu"] = round(self.mfu_of(rate), 4)
            status += f" | MFU {100 * last['mfu']:.1f}%"
        if self._tokens is not None:  # every rank's real tokens: one all-reduce per log
            tokens = torch.as_tensor(self._tokens, device=self.engine.device)
            token_rate = float(self.engine.topology.batch_sum(tokens)) / seconds
            self._tokens = None
            last["tokens_per_s"] = round(token_rate, 1)
            status += f" | {format_rate(token_rate)} tok/s"
        if self.report_memory:
            memory = self.engine.memory_report()
            last["memory"] = memory
            state = sum(v for k, v in memory.items() if k != "peak_device" and v)
            status += f" | model state {state / 2**20:.1f} MiB/rank"
            if memory["peak_device"] is not None:
                status += f", peak {memory['peak_device'] / 2**30:.2f} GiB"
        return status
