"""mf.fit: the whole training loop in one call (data sharding, evaluation, progress,
history, checkpoints and automatic resume)."""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from meshfit import watchdog
from meshfit.batch_errors import first_batch_explained
from meshfit.checkpoint import (
    latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_dir_name,
)
from meshfit.data.sampling import GlobalBatchSampler
from meshfit.engine import (
    Engine,
    LossFn,
    check_batch_divides,
    create_topology,
    parallelize,
    split_batch,
)
from meshfit.errors import MeshfitError
from meshfit.progress import TrainingDisplay, format_duration, format_rate
from meshfit.topology import Topology

Callback = Callable[[int, Engine], None]


@dataclass
class History:
    """What a `fit` run recorded: one dict per step ("step", "loss", "lr", "time", and
    "eval_loss" / "samples_per_s" / "tokens_per_s" on the steps where they were measured)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    engine: Engine | None = None  # the engine that trained (its model, rank, device)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        return [(r["step"], r["eval_loss"]) for r in self.records if "eval_loss" in r]

    @property
    def final_loss(self) -> float | None:
        return self.records[-1]["loss"] if self.records else None

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
    **parallelize_options: Any,
) -> History:
    """Train `model` on `dataset` under `plan` and return the History (on every rank).

    dataset: a map-style Dataset of (inputs, targets) samples, or a pair of tensors
        (inputs, targets) whose first dimension is the sample; with loss_fn="model", of
        the mappings the model takes, labels included.
    batch_size: the GLOBAL batch, split over data-parallel ranks and micro-batches.
    max_steps / epochs: how long to train (one of them).
    eval_dataset, eval_every, eval_batches: evaluate the mean loss on up to
        `eval_batches` global batches every `eval_every` steps and at the end.
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
    callbacks: functions called as cb(step, engine) on every rank after each step (and
        after that step's checkpoint, if any).

    Other keywords go to `parallelize` as they are: optimizer, grad_clip, lr_scheduler,
    compile, tp_plan, pp_split, ... (see its docstring). example_inputs defaults to one
    micro-batch of `dataset` under a pipeline plan. A keyword that neither fit nor
    parallelize takes is refused before anything starts.
    """
    _check_parallelize_options(parallelize_options)
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
    train_data = as_dataset(dataset, "dataset")
    eval_data = as_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    if checkpoint_every and not checkpoint_dir:
        raise MeshfitError("checkpoint_every needs checkpoint_dir=... (where to save)")

    watchdog.set_dump_dir(checkpoint_dir)  # stacks of a hang go next to the checkpoints
    topology = create_topology(plan)
    if "example_inputs" not in parallelize_options:
        parallelize_options["example_inputs"] = _pipeline_example(
            topology, train_data, batch_size, model_loss=loss_fn == "model"
        )
    engine = parallelize(model, topology, loss_fn=loss_fn, **parallelize_options)
    if report_memory:
        engine.memory_report()  # measure gradients from the first step on
    check_batch_divides(batch_size, engine.dp_size, engine.plan.num_microbatches)
    num_samples = _check_size(train_data, batch_size, "dataset")
    if eval_data is not None:
        _check_size(eval_data, batch_size, "eval_dataset")
    steps_per_epoch = num_samples // batch_size
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch
    config = _RunConfig(batch_size=batch_size, seed=seed, num_samples=num_samples, shuffle=shuffle)

    history = _HistoryFile.of_run(history_file, checkpoint_dir, writer=engine.rank == 0)
    start = _resume(engine, checkpoint_dir if resume else None, config, history)
    display = TrainingDisplay(total_steps, start.step, enabled=progress and engine.rank == 0)
    _announce(display, engine, batch_size, steps_per_epoch, total_steps, start.checkpoint)
    history.rewrite(start.records)

    loader = first_batch_explained(
        _train_loader(train_data, engine, config, start.step, total_steps, num_workers), "dataset"
    )
    callbacks = list(callbacks)
    log = _StepLog(engine, display, batch_size, report_memory, start.records, start.step)
    step = start.step
    try:
        for batch in loader:
            inputs, targets = engine.split_batch(batch)
            loss = engine.step_local(inputs, targets)
            step += 1
            lr = engine.optimizer.param_groups[0].get("lr", 0.0)
            log.add(step, loss, lr, _real_tokens(inputs, targets))
            at_end = step == total_steps
            if step % log_every == 0 or at_end:
                log.flush(step, log_line=True)
            with log.paused():  # eval and saves do not count against throughput
                if eval_data is not None and _due(step, eval_every, at_end):
                    log.flush(step, log_line=False)
                    eval_loss = _evaluate(engine, eval_data, batch_size, eval_batches, num_workers)
                    log.add_eval(step, eval_loss)
                if checkpoint_dir and _due(step, checkpoint_every, at_end):
                    log.flush(step, log_line=False)
                    _save(engine, checkpoint_dir, step, config, keep_checkpoints, history, log)
            for callback in callbacks:
                callback(step, engine)
        log.flush(step, log_line=False)
    finally:
        display.close()
    history.append_new(log.records)
    log.summarize(step - start.step)
    return History(log.records, engine=engine)


# ---- pieces ----------------------------------------------------------------------


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
        self._pending: list[tuple[int, torch.Tensor, float]] = []  # (step, loss, lr)
        self._tokens: torch.Tensor | int | None = None  # this rank's real tokens since the last log
        self._last_time, self._last_step = time.perf_counter(), start_step
        self._start_time = time.perf_counter()

    def add(
        self, step: int, loss: torch.Tensor, lr: float, tokens: torch.Tensor | int | None
    ) -> None:
        """Keep a step's loss and real-token count (still on the device) until the next
        flush."""
        if tokens is not None:
            self._tokens = tokens if self._tokens is None else self._tokens + tokens
        self._pending.append((step, loss, lr))

    def flush(self, step: int, log_line: bool) -> None:
        """Read the pending losses into records and show the status at `step`."""
        if not self._pending:
            return
        with watchdog.phase("log", f"the log of step {step}", step=step):  # an all-reduce
            self._read_pending()
            self.display.update(step, self._measure(step), log_line=log_line)

    def add_eval(self, step: int, eval_loss: float) -> None:
        """Put `step`'s eval loss on its record and print it."""
        self.records[-1]["eval_loss"] = eval_loss
        self.display.print(f"step {step}: eval loss {eval_loss:.4f}")

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
        values = torch.stack([loss for _, loss, _ in self._pending]).tolist()
        for (step, _, lr), value in zip(self._pending, values, strict=True):
            if not math.isfinite(value):
                raise MeshfitError(
                    f"the loss became {value} at step {step}; lower the learning rate, set "
                    f"grad_clip=1.0, or use precision='bf16' instead of 'fp16'"
                )
            elapsed = round(time.perf_counter() - self._start_time, 4)
            self.records.append({"step": step, "loss": value, "lr": lr, "time": elapsed})
        self._pending.clear()

    def _measure(self, step: int) -> str:
        """Add throughput (and memory) to the last record; returns the status text."""
        now = time.perf_counter()
        seconds = max(now - self._last_time, 1e-9)
        rate = (step - self._last_step) * self.batch_size / seconds
        self._last_time, self._last_step = now, step
        last = self.records[-1]
        last["samples_per_s"] = round(rate, 2)
        status = f"loss {last['loss']:.4f} | {format_rate(rate)} samples/s"
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


def _due(step: int, every: int | None, at_end: bool) -> bool:
    """Whether a periodic job (eval, checkpoint) runs at `step`: every N steps and at the end."""
    return at_end or bool(every and step % every == 0)


def _resume(
    engine: Engine, checkpoint_dir: str | None, config: _RunConfig, history: _HistoryFile
) -> _Start:
    """Continue the run saved in `checkpoint_dir` if it holds a checkpoint: load the engine,
    restore this rank's RNG and read the history up to that step. Otherwise seed a new
    run (each rank its own seed, so ranks draw different dropout masks, as separate
    processes would)."""
    if checkpoint_dir and latest_checkpoint(checkpoint_dir):
        meta = engine.load(checkpoint_dir)
        step = _check_resume(meta, config, meta["path"])
        _restore_rng(meta.get("rank_state"))
        return _Start(step, history.read(step), meta["path"])
    torch.manual_seed(config.seed + engine.rank)
    random.seed(config.seed + engine.rank)
    return _Start()


def _train_loader(
    data: Dataset,
    engine: Engine,
    config: _RunConfig,
    start_step: int,
    stop_step: int,
    workers: int,
) -> DataLoader:
    """This rank's share of each global batch from `start_step` up to `stop_step`."""
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
        num_workers=workers,
        pin_memory=engine.device.type == "cuda",
        # Its own generator: a DataLoader otherwise draws a seed from the global RNG when
        # it starts, which would shift the model's dropout stream after a resume.
        generator=torch.Generator().manual_seed(config.seed),
    )


def as_dataset(data: Any, what: str) -> Dataset:
    """A map-style Dataset from a Dataset or an (inputs, targets) pair of tensors."""
    if isinstance(data, IterableDataset):
        raise MeshfitError(
            f"{what} is an IterableDataset; fit needs a map-style dataset (with __len__ "
            f"and __getitem__) so it can give each rank its own samples and resume exactly"
        )
    if isinstance(data, Mapping) and not isinstance(data, Dataset):
        raise MeshfitError(
            f"{what} is a {type(data).__name__}; give a torch Dataset of (inputs, targets) "
            f"samples or a pair of tensors (inputs, targets)"
        )
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
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(t, torch.Tensor) for t in data)
    ):
        inputs, targets = data
        if inputs.ndim == 0 or targets.ndim == 0 or len(inputs) != len(targets):
            raise MeshfitError(
                f"{what} as (inputs, targets) needs two tensors with the same first "
                f"dimension (one row per sample)"
            )
        return TensorDataset(inputs, targets)
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
        if not callable(callback):
            raise MeshfitError(
                f"callbacks must be functions called as fn(step, engine), not {callback!r}"
            )


def _pipeline_example(
    topology: Topology, data: Dataset, batch_size: int, *, model_loss: bool
) -> Any:
    """One micro-batch of inputs for a pipeline plan to time its blocks on (so its
    stages are balanced by measured cost); None for other plans."""
    plan = topology.plan
    if plan.pp == 1 or len(data) == 0:
        return None
    size = max(1, min(len(data), batch_size // (topology.dp_size * plan.num_microbatches)))
    inputs, _ = split_batch(default_collate([data[i] for i in range(size)]), model_loss)
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
    engine: Engine, data: Dataset, batch_size: int, limit: int | None, workers: int
) -> float:
    sampler = GlobalBatchSampler(
        len(data), batch_size, dp_size=engine.dp_size, dp_rank=engine.dp_rank, shuffle=False
    )
    if limit is not None:
        sampler.stop_step = min(sampler.stop_step, limit)
    loader = DataLoader(
        data, batch_sampler=sampler, num_workers=workers, generator=torch.Generator().manual_seed(0)
    )
    batches = first_batch_explained(loader, "eval_dataset")
    losses = [engine.evaluate_local(*engine.split_batch(batch)) for batch in batches]
    return float(torch.stack(losses).mean())


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
            extra={"fit": {"step": step, **asdict(config)}},
            rank_state=rank_state,
            latest_root=root,
        )
        prune_checkpoints(root, keep)


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
    resumed_from: str | None,
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
    if engine.pipeline is not None:
        display.print(f"meshfit: {engine.pipeline.describe()}")
    if engine.plan.tp > 1:
        from meshfit.parallel.tensor import describe_tp

        split = describe_tp(engine.user_model)
        if split:
            display.print(f"meshfit: {split}")
    if resumed_from:
        display.print(f"meshfit: resumed from {resumed_from} (step {engine.step_count})")
