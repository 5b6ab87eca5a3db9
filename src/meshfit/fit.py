"""mf.fit: the whole training loop in one call (data sharding, evaluation, progress,
history, checkpoints and automatic resume)."""

from __future__ import annotations

import inspect
import itertools
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from meshfit import watchdog
from meshfit.batch_errors import first_batch_explained
from meshfit.batches import check_batch_divides, split_batch
from meshfit.callbacks import Callback as CallbackBase
from meshfit.callbacks import adds_fields, make_loggers, wants_every_step
from meshfit.checkpoint import (
    latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_dir_name,
)
from meshfit.data.columns import as_columns
from meshfit.data.reading import Reading
from meshfit.data.sampling import GlobalBatchSampler, StreamShare
from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.options import LossFn
from meshfit.prepare import auto_requested, create_topology, parallelize
from meshfit.progress import TrainingDisplay, format_duration, format_rate
from meshfit.topology import Topology

Callback = Callable[[int, Engine], None]


@dataclass
class History:
    """What a `fit` run recorded: one dict per step ("step", "loss", "lr" (the first
    parameter group's, as the step trained with it), "time", and
    "eval_loss" / "samples_per_s" / "tokens_per_s" on the steps where they were measured)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    engine: Engine | None = None  # the engine that trained (its model, rank, device)
    stopped: str | None = None  # why a callback stopped the run early, if one did
    # plan="auto": the plan chosen, its predicted step time and memory, and the measured
    planned: dict[str, Any] | None = None

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        return [(r["step"], r["eval_loss"]) for r in self.records if "eval_loss" in r]

    @property
    def final_loss(self) -> float | None:
        return self.records[-1]["loss"] if self.records else None

    def plot(self, path: str = "history.png", title: str | None = None) -> str:
        """Write the run's curves (loss, eval loss, metrics, lr) as a PNG (matplotlib)."""
        from meshfit.plot import plot_records

        return plot_records(self.records, path, title)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)


def fit(
    model: nn.Module,
    dataset: Dataset | Sequence[torch.Tensor],
    *,
    loss_fn: LossFn | None = None,
    batch_size: int,
    plan: Any = None,
    max_steps: int | None = None,
    epochs: int | None = None,
    eval_dataset: Dataset | Sequence[torch.Tensor] | None = None,
    validation_split: float | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    inputs: str | Sequence[str] | None = None,
    targets: str | None = None,
    eval_every: int | None = None,
    eval_batches: int | None = None,
    report_memory: bool = False,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 2,
    resume: bool = True,
    log_every: int = 10,
    history_file: str | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_workers: int = 0,
    progress: bool = True,
    callbacks: Iterable[Callback] = (),
    loggers: Sequence[str] | None = None,
    log_dir: str | None = None,
    **parallelize_options: Any,
) -> History:
    """Train `model` on `dataset` under `plan` and return the History (on every rank).

    dataset: a map-style Dataset of (inputs, targets) samples, or a pair of tensors
        (inputs, targets) whose first dimension is the sample; with loss_fn="model", of
        the mappings the model takes, labels included.
    batch_size: the GLOBAL batch, split over data-parallel ranks and micro-batches.
    max_steps / epochs: how long to train (one of them).
    eval_dataset, eval_every, eval_batches: evaluate the mean loss on up to
        `eval_batches` global batches every `eval_every` steps and at the end; without
        eval_every, at the end of every epoch of an `epochs` run (as Keras does), and
        at the end of a `max_steps` run. The start-up lines say which. A callback that
        watches an evaluation value the run never computes (or EarlyStopping on one
        computed only at the end) is refused before anything starts.
    validation_split: instead of eval_dataset, hold out the last fraction of `dataset`
        (taken before shuffling, as Keras does) for evaluation.
    collate: the function from a list of samples to a batch (e.g. a transformers data
        collator that pads); default: torch's default_collate.
    inputs, targets: for samples that are dicts of columns (a Hugging Face dataset's
        rows): the column(s) the model takes and the one the loss compares with, e.g.
        inputs="input_ids", targets="labels" (inputs=[...] gives the model a dict).
    checkpoint_dir, checkpoint_every: save every N steps and at the end; with
        resume=True a run finds the newest checkpoint there and continues the exact same
        run (weights, optimizer, data position, RNG state). A save that fails (disk
        full, an I/O error, on any rank) stops the run on every rank with one
        MeshfitError naming the directory and the OS error, rather than training on
        without checkpoints and risking hours of work unnoticed; the previous checkpoint
        stays whole and is where the next run resumes.
    report_memory: add rank 0's model-state bytes (parameters + gradients + optimizer
        state, this rank's share) and, on a GPU, peak memory to the log lines and the
        history (Engine.memory_report).
    history_file: JSONL written by rank 0 (default: <checkpoint_dir>/history.jsonl).
    callbacks: `mf.Callback` objects (on_step_end / on_eval_end / on_log hooks that
        get each record and may stop the run by returning True; built-ins
        mf.EarlyStopping, mf.BestCheckpoint, mf.LearningRateMonitor), or functions called as cb(step, engine)
        on every rank after each step (and after that step's checkpoint, if any).
    loggers, log_dir: ["csv", "tensorboard"] write every record to log_dir
        (metrics.csv; TensorBoard event files, which need the tensorboard package).

    Other keywords go to `parallelize` as they are: optimizer, grad_clip, lr_scheduler,
    compile, tp_plan, pp_split, ... (see its docstring). example_inputs defaults to one
    micro-batch of `dataset` under a pipeline plan (two samples of it under tensor
    parallel, to trace the split on). A keyword that neither fit nor
    parallelize takes is refused before anything starts.
    """
    _check_parallelize_options(parallelize_options)
    callbacks = list(callbacks) if isinstance(callbacks, Iterable) else callbacks
    _check_args(batch_size, max_steps, epochs, log_every, checkpoint_every, eval_every)
    _check_options(
        eval_batches=eval_batches,
        keep_checkpoints=keep_checkpoints,
        seed=seed,
        num_workers=num_workers,
        history_file=history_file,
        checkpoint_dir=checkpoint_dir,
        callbacks=callbacks,
        flags={
            "resume": resume,
            "shuffle": shuffle,
            "progress": progress,
            "report_memory": report_memory,
        },
    )
    observers = make_loggers(loggers, log_dir)
    reading = Reading(collate, inputs, targets)
    train_data = as_dataset(dataset, "dataset")
    eval_data = as_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    if validation_split is not None:
        train_data, eval_data = _split_off(train_data, validation_split, eval_data)
    _check_streams(train_data, eval_data, epochs, eval_batches, num_workers)
    if checkpoint_every and not checkpoint_dir:
        raise MeshfitError("checkpoint_every needs checkpoint_dir=... (where to save)")

    watchdog.set_dump_dir(checkpoint_dir)  # stacks of a hang go next to the checkpoints
    auto = None
    if auto_requested(plan):
        auto = _choose_auto_plan(
            model, auto_requested(plan), train_data, batch_size, reading, loss_fn,
            parallelize_options,
        )  # fmt: skip
        plan = auto.plan
    topology = create_topology(plan)
    profile = auto.result.profile if auto is not None else None  # profiled once
    mfu_of = _mfu_meter(model, topology, train_data, reading, loss_fn, profile)  # before any split
    if "example_inputs" not in parallelize_options:
        parallelize_options["example_inputs"] = _split_example(
            topology, train_data, batch_size, reading, model_loss=loss_fn == "model"
        )
    engine = parallelize(model, topology, loss_fn=loss_fn, **parallelize_options)
    engine.planned = auto
    if report_memory:
        engine.memory_report()  # measure gradients from the first step on
    check_batch_divides(batch_size, engine.dp_size, engine.plan.num_microbatches)
    if isinstance(train_data, IterableDataset):  # a stream: no length, read in order
        num_samples = -1
    else:
        num_samples = _check_size(train_data, batch_size, "dataset")
    if eval_data is not None and not isinstance(eval_data, IterableDataset):
        _check_size(eval_data, batch_size, "eval_dataset")
    steps_per_epoch = max(num_samples, 0) // batch_size
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch
    eval_interval = eval_every
    if eval_interval is None and epochs is not None and eval_data is not None:
        eval_interval = steps_per_epoch  # Keras evaluates at the end of every epoch
    _check_monitors(callbacks, eval_data, eval_interval, parallelize_options.get("metrics"))
    config = _RunConfig(batch_size=batch_size, seed=seed, num_samples=num_samples, shuffle=shuffle)

    history = _HistoryFile.of_run(history_file, checkpoint_dir, writer=engine.rank == 0)
    start = _resume(engine, checkpoint_dir if resume else None, config, history)
    display = TrainingDisplay(
        total_steps,
        start.step,
        enabled=progress and engine.rank == 0,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
    )
    _announce(display, engine, batch_size, steps_per_epoch, total_steps, start)
    if eval_data is not None:
        schedule = _eval_schedule(eval_data, batch_size, eval_batches, eval_every, epochs)
        display.print(f"meshfit: {schedule}")
    history.rewrite(start.records)

    loader = first_batch_explained(
        _train_loader(train_data, engine, config, start.step, total_steps, num_workers, reading),
        "dataset",
    )
    plain = [c for c in callbacks if not isinstance(c, CallbackBase)]  # fn(step, engine)
    hooks = _Hooks([c for c in callbacks if isinstance(c, CallbackBase)] + observers, engine)
    log = _StepLog(engine, display, batch_size, report_memory, start.records, start.step)
    log.mfu_of = mfu_of
    hooks.begin(checkpoint_dir, len(log.records))
    step = start.step
    try:
        for batch in loader:
            batch_inputs, batch_targets = engine.split_batch(reading.pick(batch))
            # the rate this step trains with: the scheduler moves it inside step_local
            lr = engine.optimizer.param_groups[0].get("lr", 0.0)
            fields = hooks.step_fields(step + 1)
            loss = engine.step_local(batch_inputs, batch_targets)
            step += 1
            log.add(step, loss, lr, _real_tokens(batch_inputs, batch_targets), fields)
            at_end = step == total_steps
            logged = step % log_every == 0 or at_end
            if logged or hooks.every_step:
                log.flush(step, log_line=logged)
            hooks.after_flush(log.records)
            with log.paused():  # eval and saves do not count against throughput
                if eval_data is not None and _due(step, eval_interval, at_end):
                    log.flush(step, log_line=False)
                    hooks.after_flush(log.records)
                    eval_loss, eval_metrics = _evaluate(
                        engine, eval_data, batch_size, eval_batches, num_workers, reading
                    )
                    log.add_eval(step, eval_loss, eval_metrics)
                    hooks.after_eval(log.records[-1])
                saving = checkpoint_dir and (_due(step, checkpoint_every, at_end) or hooks.stop)
                if saving:
                    log.flush(step, log_line=False)
                    hooks.after_flush(log.records)
                    _save(engine, checkpoint_dir, step, config, keep_checkpoints, history, log)
            for callback in plain:
                callback(step, engine)
            if hooks.stop:
                display.print(f"meshfit: stopped after step {step}: {hooks.stop}")
                break
        log.flush(step, log_line=False)
        hooks.after_flush(log.records)
        if step < total_steps and not hooks.stop:  # only a stream runs out
            if step == start.step:
                raise MeshfitError(
                    f"dataset (a stream) ended before one global batch of {batch_size} "
                    f"samples after step {step}; give it more samples or a smaller batch_size"
                )
            display.print(f"meshfit: the dataset stream ended after step {step}")
    finally:
        display.close()
    history.append_new(log.records)
    log.summarize(step - start.step)
    result = History(log.records, engine=engine, stopped=hooks.stop)
    if auto is not None:
        result.planned = auto.as_record()
        result.planned.update(_measured_against_plan(auto, log.records, batch_size, engine))
        display.print(f"meshfit: {_closed_loop_line(result.planned)}")
    hooks.end(result)
    return result


# ---- pieces ----------------------------------------------------------------------


class _Hooks:
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


@dataclass(frozen=True)
class _RunConfig:
    """The settings that fix the data order: a run resumes only with the same ones."""

    batch_size: int
    seed: int
    num_samples: int
    shuffle: bool


@dataclass
class _Start:
    """Where a run begins: step 0, or the step of the checkpoint it resumed from (with
    the history records up to that step)."""

    step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None  # the path resumed from
    changes: list[str] = field(default_factory=list)  # what differs from the checkpoint


class _HistoryFile:
    """The run's records as JSON lines. Every rank reads it on resume; only the writer
    (rank 0) writes it. No path: nothing is read or written."""

    def __init__(self, path: str | None, writer: bool) -> None:
        self.path = path
        self.writer = writer and bool(path)
        self._written = 0  # how many of the run's records the file holds

    @classmethod
    def of_run(cls, path: str | None, checkpoint_dir: str | None, writer: bool) -> _HistoryFile:
        """`path`, or <checkpoint_dir>/history.jsonl when there is a checkpoint_dir."""
        if not path and checkpoint_dir:
            path = os.path.join(checkpoint_dir, "history.jsonl")
        return cls(path, writer)

    def read(self, up_to_step: int) -> list[dict[str, Any]]:
        """The records of steps up to `up_to_step` ([] when there is no file)."""
        if not self.path or not os.path.isfile(self.path):
            return []
        records = []
        with open(self.path) as f:
            for line in f:
                line = line.strip()
                if line:
                    record = json.loads(line)
                    if record["step"] <= up_to_step:
                        records.append(record)
        return records

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file with `records` (atomically)."""
        self._written = len(records)
        if not self.writer:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, self.path)

    def append_new(self, records: list[dict[str, Any]]) -> None:
        """Append the records added to `records` since the last write."""
        new, self._written = records[self._written :], len(records)
        if not self.writer or not new:
            return
        with open(self.path, "a") as f:
            for record in new:
                f.write(json.dumps(record) + "\n")


class _StepLog:
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


def _check_parallelize_options(options: dict[str, Any]) -> None:
    """Refuse keywords that `parallelize` does not take (fit passes its others there)."""
    accepted = [
        name
        for name, param in inspect.signature(parallelize).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = [name for name in options if name not in accepted]
    if unknown:
        raise MeshfitError(
            f"fit got unknown keyword(s) {', '.join(repr(n) for n in unknown)}: fit passes "
            f"the keywords it does not take itself to parallelize, whose options are "
            f"{', '.join(accepted)}"
        )


def _check_streams(
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


def _split_off(data: Dataset, fraction: Any, eval_data: Dataset | None) -> tuple[Dataset, Dataset]:
    """Keras' validation_split: the LAST `fraction` of the samples, before any shuffling,
    become the evaluation set; the rest is trained on."""
    if eval_data is not None:
        raise MeshfitError("give eval_dataset or validation_split, not both")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise MeshfitError(
            f"validation_split must be a fraction between 0 and 1, e.g. 0.1, not {fraction!r}"
        )
    n = len(data)
    held = int(n * fraction)
    if held == 0 or held == n:
        raise MeshfitError(
            f"validation_split={fraction} of {n} samples leaves {held} for evaluation and "
            f"{n - held} for training; use a fraction that leaves samples on both sides"
        )
    return Subset(data, range(n - held)), Subset(data, range(n - held, n))


def _check_monitors(
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


def _eval_schedule(
    eval_data: Any, batch_size: int, eval_batches: int | None, eval_every: int | None, epochs: Any
) -> str:
    """When the run evaluates, and on what, in words, for the start-up lines."""
    if isinstance(eval_data, IterableDataset):
        size = f"{eval_batches} global batches of a stream"
    else:
        batches = len(eval_data) // batch_size
        size = f"{min(batches, eval_batches or batches) * batch_size} samples"
    if eval_every is not None:
        when = f"every {eval_every} steps and at the end"
    elif epochs is not None:
        when = "at the end of every epoch"
    else:
        when = "at the end of the run (pass eval_every=N to evaluate during training)"
    return f"evaluating on {size} {when}"


def _due(step: int, every: int | None, at_end: bool) -> bool:
    """Whether a periodic job (eval, checkpoint) runs at `step`: every N steps and at the end."""
    return at_end or bool(every and step % every == 0)


def _resume(
    engine: Engine, checkpoint_dir: str | None, config: _RunConfig, history: _HistoryFile
) -> _Start:
    """Continue the run saved in `checkpoint_dir` if it holds a checkpoint: load the engine,
    restore this rank's RNG and read the history up to that step. Otherwise seed a new
    run: each data shard and pipeline stage its own seed, so they draw different dropout
    masks, as separate processes would; the ranks of a tensor-parallel group one seed,
    as they compute the same replicated activations (Topology.random_stream)."""
    if checkpoint_dir and latest_checkpoint(checkpoint_dir):
        wanted = _hyperparameters(engine.optimizer)
        meta = engine.load(checkpoint_dir)
        step = _check_resume(meta, config, meta["path"])
        changes = _keep_new_hyperparameters(engine, wanted, meta["path"])
        if meta.get("plan") != str(engine.plan):
            changes.append(f"plan {meta.get('plan')} -> {engine.plan} (resharded)")
        cut = engine.runner.pipeline_cut
        if "pipeline_cut" in meta and meta["pipeline_cut"] != cut:  # recorded since issue 32
            changes.append(f"pipeline cut {_cut(meta['pipeline_cut'])} -> {_cut(cut)}")
        _restore_rng(meta.get("rank_state"))
        return _Start(step, history.read(step), meta["path"], changes)
    stream = engine.topology.random_stream  # shared by a tensor-parallel group
    torch.manual_seed(config.seed + stream)
    random.seed(config.seed + stream)
    return _Start()


def _cut(starts: list[int] | None) -> str:
    """A pipeline cut as the first block of each stage ("none" without pp)."""
    return "stages from blocks " + ", ".join(map(str, starts)) if starts else "none"


def _train_loader(
    data: Dataset,
    engine: Engine,
    config: _RunConfig,
    start_step: int,
    stop_step: int,
    workers: int,
    reading: Reading,
) -> DataLoader:
    """This rank's share of each global batch from `start_step` up to `stop_step`."""
    if isinstance(data, IterableDataset):
        share = StreamShare(
            data,
            config.batch_size,
            dp_size=engine.dp_size,
            dp_rank=engine.dp_rank,
            start_step=start_step,
            stop_step=stop_step,
        )
        return DataLoader(
            share,
            batch_size=config.batch_size // engine.dp_size,
            collate_fn=reading.collate_fn,
            pin_memory=engine.device.type == "cuda",
        )
    sampler = GlobalBatchSampler(
        config.num_samples,
        config.batch_size,
        dp_size=engine.dp_size,
        dp_rank=engine.dp_rank,
        seed=config.seed,
        start_step=start_step,
        stop_step=stop_step,
        shuffle=config.shuffle,
    )
    return DataLoader(
        data,
        batch_sampler=sampler,
        collate_fn=reading.collate_fn,
        num_workers=workers,
        pin_memory=engine.device.type == "cuda",
        # Its own generator: a DataLoader otherwise draws a seed from the global RNG when
        # it starts, which would shift the model's dropout stream after a resume.
        generator=torch.Generator().manual_seed(config.seed),
    )


def as_dataset(data: Any, what: str) -> Dataset:
    """A map-style Dataset from a Dataset, an (inputs, targets) pair of columns (tensors,
    numpy arrays, lists, or dicts of them) or one dict of columns (data/columns.py)."""
    if isinstance(data, IterableDataset):
        return data  # a stream (data/sampling.StreamShare reads it)
    columns = as_columns(data, what)  # (x, y) as tensors, arrays, lists or dicts of them
    if columns is not None:
        return columns
    if (
        isinstance(data, (tuple, list))
        and len(data) != 2
        and data
        and all(isinstance(t, torch.Tensor) for t in data)
    ):
        raise MeshfitError(
            f"{what} is a {type(data).__name__} of {len(data)} tensors; give the pair "
            f"(inputs, targets), or a Dataset of (inputs, targets) samples"
        )
    if isinstance(data, Dataset) or (
        hasattr(data, "__getitem__")
        and hasattr(data, "__len__")
        and not isinstance(data, (str, bytes))
    ):
        return data
    raise MeshfitError(
        f"{what} must be a torch Dataset of (inputs, targets) samples or a pair of "
        f"tensors (inputs, targets), not {type(data).__name__}"
    )


def _check_args(
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
        "checkpoint_every": checkpoint_every,
        "eval_every": eval_every,
    }
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise MeshfitError(f"{name} must be a positive whole number, not {value!r}")


def _check_options(
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


def _mfu_meter(
    model: nn.Module,
    topology: Topology,
    data: Dataset,
    reading: Reading,
    loss_fn: Any,
    profile: Any = None,
) -> Callable[[float], float] | None:
    """samples/s -> MFU over every device of the job, where their peak is known."""
    from meshfit.planner.mfu import peak_flops, training_flops_per_sample

    peak = peak_flops(topology.device, topology.plan.precision)
    if peak is None:
        return None
    samples = (
        list(itertools.islice(iter(data), 1)) if isinstance(data, IterableDataset) else [data[0]]
    )
    inputs, targets = split_batch(reading.pick(reading.collate_fn(samples)), loss_fn == "model")
    flops = training_flops_per_sample(model, inputs, loss_fn, targets, profile)
    if flops is None:
        return None
    world = topology.plan.world_size or 1
    return lambda samples_per_s: flops * samples_per_s / (world * peak)


def _choose_auto_plan(
    model: nn.Module,
    plan: str,
    data: Dataset,
    batch_size: int,
    reading: Reading,
    loss_fn: Any,
    options: dict[str, Any],
) -> Any:
    """plan="auto": the planner's choice for this job, profiled on two samples."""
    from meshfit.planner.auto import choose_plan

    samples = (
        list(itertools.islice(iter(data), 2))
        if isinstance(data, IterableDataset)
        else [data[i] for i in range(min(len(data), 2))]
    )
    if not samples:
        raise MeshfitError("plan='auto' needs at least one sample in the dataset to plan on")
    inputs, targets = split_batch(reading.pick(reading.collate_fn(samples)), loss_fn == "model")
    return choose_plan(
        model,
        plan,
        batch_size=batch_size,
        example_inputs=options.get("example_inputs", inputs),
        example_targets=targets,
        loss_fn=loss_fn,
        optimizer=options.get("optimizer"),
        compiled=bool(options.get("compile", False)),
    )


def _measured_against_plan(
    auto: Any, records: list[dict[str, Any]], batch_size: int, engine: Engine
) -> dict[str, Any]:
    """The run's measured step time (median over the logged rates after the first, which
    holds start-up) and, on a GPU, peak memory, beside what the planner predicted."""
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")]
    measured: dict[str, Any] = {}
    if rates:
        rates = rates[1:] or rates
        measured["measured_step_time_s"] = batch_size / statistics.median(rates)
    if engine.device.type == "cuda":
        measured["measured_memory_bytes"] = torch.cuda.max_memory_allocated(engine.device)
    return measured


def _closed_loop_line(planned: dict[str, Any]) -> str:
    parts = []
    if "step_time_s" in planned and "measured_step_time_s" in planned:
        predicted, measured = planned["step_time_s"], planned["measured_step_time_s"]
        parts.append(
            f"step time predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
            f"(x{measured / predicted:.2f})"
        )
    if "measured_memory_bytes" in planned:
        predicted, measured = planned["memory_bytes"], planned["measured_memory_bytes"]
        parts.append(
            f"memory per rank predicted {predicted / 2**30:.2f} GiB, peak "
            f"{measured / 2**30:.2f} GiB (x{measured / predicted:.2f})"
        )
    else:
        parts.append(f"memory per rank predicted {planned['memory_bytes'] / 2**30:.3f} GiB")
    return "the planner's prediction against this run: " + "; ".join(parts)


def _split_example(
    topology: Topology, data: Dataset, batch_size: int, reading: Reading, *, model_loss: bool
) -> Any:
    """One micro-batch of inputs for a pipeline plan to count its blocks' FLOPs on (so
    its stages are balanced by them), or two samples for tensor parallel to trace and
    check its split on (the user's batch, not one it makes up: a vision or speech model
    takes no token ids); None for other plans."""
    plan = topology.plan
    if plan.pp == 1 and plan.tp == 1:
        return None
    size = topology.microbatch_size(batch_size)
    if plan.pp == 1:
        size = min(size, 2)
    samples = (
        list(itertools.islice(iter(data), size))
        if isinstance(data, IterableDataset)
        else [data[i] for i in range(min(len(data), size))]
    )
    if not samples:
        return None
    batch = reading.pick(reading.collate_fn(samples))
    inputs, _ = split_batch(batch, model_loss)
    return inputs


def _check_size(data: Dataset, batch_size: int, what: str) -> int:
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


def _real_tokens(inputs: Any, targets: Any) -> torch.Tensor | int | None:
    """This rank's real tokens in a step: where the attention mask is 1, else where the
    integer targets are not -100 (ignored), else every token id of [batch, seq] integer
    inputs; None when the batch holds no tokens."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if not isinstance(ids, torch.Tensor) or ids.ndim < 2 or ids.is_floating_point():
        return None  # not token ids (an image batch, features)
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if isinstance(mask, torch.Tensor) and not mask.is_floating_point():
        return mask.sum()
    if isinstance(targets, torch.Tensor) and targets.ndim >= 2 and not targets.is_floating_point():
        return (targets != -100).sum()
    return ids.numel()


@torch.no_grad()
def _evaluate(
    engine: Engine,
    data: Dataset,
    batch_size: int,
    limit: int | None,
    workers: int,
    reading: Reading,
) -> tuple[float, dict[str, float]]:
    """The eval loss over up to `limit` global batches (for a (sum, count) loss, every
    language model's, the mean over all their counted items, as one batch of them all
    would give; for a mean loss, the mean of the equal batches' means), and each
    metric's mean over the batches ("eval_<name>")."""
    if isinstance(data, IterableDataset):
        share = StreamShare(
            data, batch_size, dp_size=engine.dp_size, dp_rank=engine.dp_rank, stop_step=limit
        )
        loader = DataLoader(
            share, batch_size=batch_size // engine.dp_size, collate_fn=reading.collate_fn
        )
    else:
        sampler = GlobalBatchSampler(
            len(data), batch_size, dp_size=engine.dp_size, dp_rank=engine.dp_rank, shuffle=False
        )
        if limit is not None:
            sampler.stop_step = min(sampler.stop_step, limit)
        loader = DataLoader(
            data,
            batch_sampler=sampler,
            collate_fn=reading.collate_fn,
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )
    batches = first_batch_explained(loader, "eval_dataset")
    losses, counts, metrics = [], [], []
    for batch in batches:
        losses.append(engine.evaluate_local(*engine.split_batch(reading.pick(batch))))
        counts.append(engine.last_eval_count)
        metrics.append(engine.last_metrics)
    names = list(metrics[0]) if metrics else []
    loss = torch.stack(losses).double()
    if counts and all(c is not None for c in counts):  # weigh each batch by its items
        items = torch.stack(counts).double().to(loss.device)
        loss = (loss * items).sum() / items.sum().clamp_min(1)
    # one read from the device
    means = torch.stack(
        [loss.mean()] + [torch.stack([m[n] for m in metrics]).mean() for n in names]
    ).tolist()
    return means[0], {f"eval_{n}": v for n, v in zip(names, means[1:], strict=True)}


def _save(
    engine: Engine,
    root: str,
    step: int,
    config: _RunConfig,
    keep: int,
    history: _HistoryFile,
    log: _StepLog,
) -> None:
    """Append the history, save a checkpoint of `step` (with this rank's RNG state), point
    `latest` at it and keep the newest `keep`. A full or failing disk stops the run on
    every rank with a MeshfitError (io_agreement.py); `latest` still names the previous
    checkpoint, the resume point."""
    from meshfit.io_agreement import on_every_rank

    on_every_rank(lambda: history.append_new(log.records), f"the history file {history.path!r}")
    rank_state = {"torch_rng": torch.get_rng_state(), "python_random": random.getstate()}
    if engine.device.type == "cuda":
        rank_state["cuda_rng"] = torch.cuda.get_rng_state(engine.device)
    with watchdog.phase("save", f"the save of the step-{step} checkpoint", step=step):
        save_checkpoint(
            engine,
            os.path.join(root, step_dir_name(step)),
            extra={"fit": {"step": step, **asdict(config)}, **_planned_extra(engine)},
            rank_state=rank_state,
            latest_root=root,
        )
        prune_checkpoints(root, keep)


def _planned_extra(engine: Engine) -> dict[str, Any]:
    """plan="auto": the planner's choice and prediction, kept in the checkpoint."""
    return {"planned": engine.planned.as_record()} if engine.planned is not None else {}


def _check_resume(meta: dict, config: _RunConfig, path: str) -> int:
    """The step a checkpoint saved by fit was taken at; refuses one saved with other settings."""
    saved = (meta.get("extra") or {}).get("fit")
    if saved is None:
        raise MeshfitError(
            f"{path!r} was saved by engine.save, not by fit, so it holds no data position; "
            f"load it with engine.load, or give fit a new checkpoint_dir"
        )
    for key, value in asdict(config).items():
        if saved.get(key) != value:
            raise MeshfitError(
                f"cannot resume from {path!r}: it was trained with {key}={saved.get(key)!r} "
                f"and this run has {key}={value!r}; resume with the same settings, or give "
                f"fit a new checkpoint_dir (or resume=False) to start over"
            )
    return int(saved["step"])


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, weight_decay, betas, ...)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _keep_new_hyperparameters(engine: Engine, wanted: list[dict[str, Any]], path: str) -> list[str]:
    """Loading a checkpoint restores the optimizer's settings too, so a run resumed with
    another learning rate would silently train on with the old one. This run's settings
    win, and each change is listed ("lr 0.001 -> 0.0003"). With an lr_scheduler, whose
    saved state would set the learning rate again, a change is refused instead."""
    loaded = _hyperparameters(engine.optimizer)
    changes = []
    for index, (new, old) in enumerate(zip(wanted, loaded, strict=False)):
        group = f" (group {index})" if len(wanted) > 1 else ""
        for key, value in new.items():
            if key == "lr" and engine.lr_scheduler is not None:
                continue  # the schedule's own value by now; its start is initial_lr
            if key in old and not _same(old[key], value):
                changes.append(f"{key} {_shown(old[key])} -> {_shown(value)}{group}")
                engine.optimizer.param_groups[index][key] = value
    if changes and engine.lr_scheduler is not None:
        raise MeshfitError(
            f"cannot resume from {path!r} with other optimizer settings ({'; '.join(changes)}) "
            f"under an lr_scheduler, whose saved state would set the learning rate again; "
            f"resume with the checkpoint's settings, or give fit a new checkpoint_dir (or "
            f"resume=False) to start over"
        )
    return changes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _restore_rng(rank_state: dict | None) -> None:
    if not rank_state:
        return  # another world size: RNG streams cannot map one to one
    torch.set_rng_state(rank_state["torch_rng"])
    state = rank_state["python_random"]
    random.setstate((state[0], tuple(state[1]), state[2]))
    if "cuda_rng" in rank_state and torch.cuda.is_available():
        torch.cuda.set_rng_state(rank_state["cuda_rng"])


def _announce(
    display: TrainingDisplay,
    engine: Engine,
    batch_size: int,
    steps_per_epoch: int,
    total_steps: int,
    start: _Start,
) -> None:
    """Print the run's opening lines: plan, workers, model size, batch split, length."""
    params = engine.num_parameters
    where = f"{engine.world_size} {'GPU' if engine.device.type == 'cuda' else 'CPU'} worker(s)"
    per_rank = batch_size // engine.dp_size
    micro = engine.plan.num_microbatches
    split = f"{engine.dp_size} rank(s) x {per_rank}"
    if micro > 1:
        split += f" ({micro} micro-batches of {per_rank // micro})"
    display.print(
        f"meshfit: plan {engine.plan} on {where} | model {params / 1e6:.2f}M parameters | "
        f"global batch {batch_size} = {split} | {steps_per_epoch} steps/epoch, "
        f"training {total_steps} steps"
    )
    if engine.planned is not None:
        display.print(f"meshfit: {engine.planned.describe()}")
    if engine.runner.describe():
        display.print(f"meshfit: {engine.runner.describe()}")
    if engine.tp_report is not None:
        split = engine.tp_report.describe()
        if split:
            display.print(f"meshfit: {split}")
    if start.checkpoint:
        display.print(
            f"meshfit: resumed from {start.checkpoint} (step {engine.step_count}): kept the "
            f"weights, optimizer state, data order (batch size, seed, shuffle) and RNG; "
            + (f"changed: {', '.join(start.changes)}" if start.changes else "no setting changed")
        )
