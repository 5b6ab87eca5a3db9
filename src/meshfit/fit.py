"""mf.fit: the whole training loop in one call (data sharding, evaluation, progress,
history, checkpoints and automatic resume)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from meshfit.data.reading import Reading
from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.launch import watchdog
from meshfit.launch.elastic import elastic_nodes, record_reached
from meshfit.options import EngineOptions, LossFn, engine_options
from meshfit.prepare import prepare
from meshfit.runtime.batch_errors import first_batch_explained
from meshfit.runtime.batches import check_batch_divides
from meshfit.runtime.examples import Examples
from meshfit.training.callbacks import Callback as CallbackBase
from meshfit.training.checks import (
    check_args,
    check_monitors,
    check_options,
    check_size,
    check_streams,
    checkpoint_interval,
)
from meshfit.training.data import as_dataset, first_samples, hold_out, real_tokens, train_loader
from meshfit.training.evaluation import eval_schedule, evaluation_loss, is_due
from meshfit.training.history import History, HistoryFile
from meshfit.training.log import Hooks, StepLog
from meshfit.training.loggers import make_loggers
from meshfit.training.planning import (
    announce_run,
    closed_loop_line,
    measured_against_plan,
    mfu_meter,
)
from meshfit.training.progress import TrainingDisplay
from meshfit.training.resume import RunConfig, resume_run, save_step

Callback = Callable[[int, Engine], None]


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
    checkpoint_every: int | str | datetime.timedelta | None = None,
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
    checkpoint_dir, checkpoint_every: save every N steps (or every so long: "30min",
        "2h", a datetime.timedelta; rank 0's clock decides, every rank saves at the same
        step) and at the end; with
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
    options = engine_options("fit does not take", loss_fn, parallelize_options)
    callbacks = list(callbacks) if isinstance(callbacks, Iterable) else callbacks
    check_args(batch_size, max_steps, epochs, log_every, checkpoint_every, eval_every)
    flags = {"resume": resume, "shuffle": shuffle, "progress": progress}
    check_options(
        eval_batches=eval_batches,
        keep_checkpoints=keep_checkpoints,
        seed=seed,
        num_workers=num_workers,
        history_file=history_file,
        checkpoint_dir=checkpoint_dir,
        callbacks=callbacks,
        flags={**flags, "report_memory": report_memory},
    )
    observers = make_loggers(loggers, log_dir)
    reading = Reading(collate, inputs, targets)
    train_data = as_dataset(dataset, "dataset")
    eval_data = as_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    if validation_split is not None:
        train_data, eval_data = hold_out(train_data, validation_split, eval_data)
    check_streams(train_data, eval_data, epochs, eval_batches, num_workers)
    if checkpoint_every and not checkpoint_dir:
        raise MeshfitError("checkpoint_every needs checkpoint_dir=... (where to save)")
    watchdog.set_dump_dir(checkpoint_dir)  # stacks of a hang go next to the checkpoints
    engine, auto, mfu_of = _build_engine(model, plan, train_data, batch_size, reading, options)
    if report_memory:
        engine.memory_report()  # measure gradients from the first step on
    run = _Run(
        engine=engine, train_data=train_data, eval_data=eval_data, reading=reading,
        batch_size=batch_size, epochs=epochs, eval_every=eval_every,
        eval_batches=eval_batches, num_workers=num_workers, log_every=log_every,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_interval(checkpoint_every),
        keep_checkpoints=keep_checkpoints,
    )  # fmt: skip
    run.measure(max_steps, seed, shuffle)
    check_monitors(callbacks, eval_data, run.eval_interval, options.metrics)
    run.begin(history_file, resume, progress, report_memory, callbacks, observers, mfu_of)
    step = run.train()
    run.history.append_new(run.log.records)
    run.log.summarize(step - run.start.step)
    result = History(
        run.log.records,
        engine=engine,
        stopped=run.hooks.stop,
        world_changes=run.start.world_changes,
    )
    if auto is not None:
        result.planned = auto.as_record()
        result.planned.update(measured_against_plan(auto, run.log.records, batch_size, engine))
        run.display.print(f"meshfit: {closed_loop_line(result.planned)}")
    run.hooks.end(result)
    return result


def _build_engine(
    model: nn.Module,
    plan: Any,
    train_data: Dataset,
    batch_size: int,
    reading: Reading,
    options: EngineOptions,
) -> tuple[Engine, Any, Any]:
    """(the engine, the planner's choice for plan="auto" or None, the MFU meter): the
    plan resolved on the dataset's first samples (prepare), the model's FLOPs counted
    before any split."""
    examples = Examples(first_samples(train_data, reading, options.loss_fn), batch_size)
    job = prepare(model, plan, options, examples)
    profile = job.auto.result.profile if job.auto is not None else None  # profiled once
    mfu_of = mfu_meter(model, job.topology, examples, options.loss_fn, profile)  # before any split
    engine = job.engine(model)
    check_batch_divides(batch_size, engine.topology, engine.plan.num_microbatches)
    return engine, job.auto, mfu_of


@dataclass
class _Run:
    """One fit run: its engine, data and schedule (set up by fit), then its state as it
    trains (begin: the resume point, history, display, hooks and step log)."""

    engine: Engine
    train_data: Dataset
    eval_data: Dataset | None
    reading: Reading
    batch_size: int
    epochs: int | None
    eval_every: int | None
    eval_batches: int | None
    num_workers: int
    log_every: int
    checkpoint_dir: str | None
    checkpoint_every: tuple[int | None, float | None]  # (steps, seconds): checkpoint_interval
    keep_checkpoints: int
    total_steps: int = 0
    steps_per_epoch: int = 0
    eval_interval: int | None = None
    config: RunConfig | None = None
    history: HistoryFile | None = None
    start: Any = None
    display: TrainingDisplay | None = None
    hooks: Hooks | None = None
    log: StepLog | None = None
    plain: list[Callback] = field(default_factory=list)  # fn(step, engine) callbacks
    last_save: float = 0.0  # time.monotonic() of the last checkpoint (or the start)
    elastic: bool = field(default_factory=lambda: elastic_nodes() is not None)

    def measure(self, max_steps: int | None, seed: int, shuffle: bool) -> None:
        """The run's length in steps and when it evaluates (checking the datasets hold
        whole global batches)."""
        if isinstance(self.train_data, IterableDataset):  # a stream: no length, in order
            num_samples = -1
        else:
            num_samples = check_size(self.train_data, self.batch_size, "dataset")
        if self.eval_data is not None and not isinstance(self.eval_data, IterableDataset):
            check_size(self.eval_data, self.batch_size, "eval_dataset")
        self.steps_per_epoch = max(num_samples, 0) // self.batch_size
        if max_steps is not None:
            self.total_steps = max_steps
        else:
            self.total_steps = self.epochs * self.steps_per_epoch
        self.eval_interval = self.eval_every
        if self.eval_interval is None and self.epochs is not None and self.eval_data is not None:
            self.eval_interval = self.steps_per_epoch  # Keras evaluates after every epoch
        self.config = RunConfig(
            batch_size=self.batch_size, seed=seed, num_samples=num_samples, shuffle=shuffle
        )

    def begin(
        self,
        history_file: str | None,
        resume: bool,
        progress: bool,
        report_memory: bool,
        callbacks: list[Any],
        observers: list[Any],
        mfu_of: Any,
    ) -> None:
        """Resume where the checkpoints say, say what the run will do, and make the
        history, display, hooks and step log it records through."""
        engine = self.engine
        self.history = HistoryFile.of_run(history_file, self.checkpoint_dir, engine.rank == 0)
        where = self.checkpoint_dir if resume else None
        self.start = resume_run(engine, where, self.config, self.history)
        self.display = TrainingDisplay(
            self.total_steps,
            self.start.step,
            enabled=progress and engine.rank == 0,
            epochs=self.epochs,
            steps_per_epoch=self.steps_per_epoch,
        )
        announce_run(
            self.display, engine, self.batch_size, self.steps_per_epoch, self.total_steps,
            self.start,
        )  # fmt: skip
        if self.eval_data is not None:
            schedule = eval_schedule(
                self.eval_data, self.batch_size, self.eval_batches, self.eval_every, self.epochs
            )
            self.display.print(f"meshfit: {schedule}")
        self.history.rewrite(self.start.records)
        self.plain = [c for c in callbacks if not isinstance(c, CallbackBase)]
        objects = [c for c in callbacks if isinstance(c, CallbackBase)]
        self.hooks = Hooks(objects + observers, engine)
        self.log = StepLog(
            engine, self.display, self.batch_size, report_memory, self.start.records,
            self.start.step,
        )  # fmt: skip
        self.log.mfu_of = mfu_of
        self.hooks.begin(self.checkpoint_dir, len(self.log.records))
        self.last_save = time.monotonic()

    def train(self) -> int:
        """Train from the resume point to the end (or a callback's stop); the last step."""
        engine, log, hooks = self.engine, self.log, self.hooks
        loader = first_batch_explained(
            train_loader(
                self.train_data, engine, self.config, self.start.step, self.total_steps,
                self.num_workers, self.reading,
            ),
            "dataset",
        )  # fmt: skip
        step = self.start.step
        try:
            for batch in loader:
                inputs, targets = engine.split_batch(self.reading.pick(batch))
                # the rate this step trains with: the scheduler moves it inside step_local
                lr = engine.optimizer.param_groups[0].get("lr", 0.0)
                fields = hooks.step_fields(step + 1)
                loss = engine.step_local(inputs, targets)
                step += 1
                if self.elastic and self.checkpoint_dir and engine.rank == 0:
                    record_reached(self.checkpoint_dir, step)  # a resume counts redone steps
                log.add(step, loss, lr, real_tokens(inputs, targets), fields)
                at_end = step == self.total_steps
                logged = step % self.log_every == 0 or at_end
                if logged or hooks.every_step:
                    log.flush(step, log_line=logged)
                hooks.after_flush(log.records)
                with log.paused():  # eval and saves do not count against throughput
                    self._evaluate_and_save(step, at_end)
                for callback in self.plain:
                    callback(step, engine)
                if hooks.stop:
                    self.display.print(f"meshfit: stopped after step {step}: {hooks.stop}")
                    break
            log.flush(step, log_line=False)
            hooks.after_flush(log.records)
            if step < self.total_steps and not hooks.stop:  # only a stream runs out
                if step == self.start.step:
                    raise MeshfitError(
                        f"dataset (a stream) ended before one global batch of "
                        f"{self.batch_size} samples after step {step}; give it more samples "
                        f"or a smaller batch_size"
                    )
                self.display.print(f"meshfit: the dataset stream ended after step {step}")
        finally:
            self.display.close()
        return step

    def _evaluate_and_save(self, step: int, at_end: bool) -> None:
        log, hooks = self.log, self.hooks
        if self.eval_data is not None and is_due(step, self.eval_interval, at_end):
            log.flush(step, log_line=False)
            hooks.after_flush(log.records)
            eval_loss, eval_metrics = evaluation_loss(
                self.engine, self.eval_data, self.batch_size, self.eval_batches,
                self.num_workers, self.reading,
            )  # fmt: skip
            log.add_eval(step, eval_loss, eval_metrics)
            hooks.after_eval(log.records[-1])
        steps, seconds = self.checkpoint_every
        due = is_due(step, steps, at_end) or bool(hooks.stop)
        if self.checkpoint_dir and seconds is not None and not due:
            due = self._time_is_up(seconds)
        if self.checkpoint_dir and due:
            log.flush(step, log_line=False)
            hooks.after_flush(log.records)
            save_step(
                self.engine, self.checkpoint_dir, step, self.config, self.keep_checkpoints,
                self.history, log, self.start.world_changes,
            )  # fmt: skip
            self.last_save = time.monotonic()

    def _time_is_up(self, seconds: float) -> bool:
        """Whether `seconds` have passed since the last save, by rank 0's clock, told to
        every rank (one broadcast of one number), so all save at the same step."""
        import torch.distributed as dist

        up = torch.tensor([time.monotonic() - self.last_save >= seconds], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized() and self.engine.world_size > 1:
            dist.broadcast(up, src=0)
        return bool(up.item())
