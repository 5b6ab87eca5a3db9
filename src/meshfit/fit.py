"""mf.fit: the whole training loop in one call (data sharding, evaluation, progress,
history, checkpoints and automatic resume)."""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from meshfit.checkpoint import (
    latest_checkpoint,
    point_latest,
    prune_checkpoints,
    save_checkpoint,
    step_dir_name,
)
from meshfit.data.sampling import GlobalBatchSampler
from meshfit.engine import (
    Engine,
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    as_plan,
    check_batch_divides,
    parallelize,
    unpack_batch,
)
from meshfit.errors import MeshfitError
from meshfit.mesh import env_world_size
from meshfit.progress import TrainingDisplay, format_duration, format_rate

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
    optimizer: OptimizerFactory | None = None,
    max_steps: int | None = None,
    epochs: int | None = None,
    eval_dataset: Dataset | Sequence[torch.Tensor] | None = None,
    eval_every: int | None = None,
    eval_batches: int | None = None,
    grad_clip: float | None = None,
    lr_scheduler: SchedulerFactory | None = None,
    compile: bool = False,
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
) -> History:
    """Train `model` on `dataset` under `plan` and return the History (on every rank).

    dataset: a map-style Dataset of (inputs, targets) samples, or a pair of tensors
        (inputs, targets) whose first dimension is the sample.
    batch_size: the GLOBAL batch, split over data-parallel ranks and micro-batches.
    max_steps / epochs: how long to train (one of them).
    eval_dataset, eval_every, eval_batches: evaluate the mean loss on up to
        `eval_batches` global batches every `eval_every` steps and at the end.
    checkpoint_dir, checkpoint_every: save every N steps and at the end; with
        resume=True a run finds the newest checkpoint there and continues the exact same
        run (weights, optimizer, data position, RNG state).
    compile: run forward and loss through torch.compile (see `parallelize`).
    report_memory: add rank 0's model-state bytes (parameters + gradients + optimizer
        state, this rank's share) and, on a GPU, peak memory to the log lines and the
        history (Engine.memory_report).
    history_file: JSONL written by rank 0 (default: <checkpoint_dir>/history.jsonl).
    callbacks: functions called as cb(step, engine) on every rank after each step (and
        after that step's checkpoint, if any).
    """
    _check_args(batch_size, max_steps, epochs, log_every, checkpoint_every, eval_every)
    train_data = as_dataset(dataset, "dataset")
    eval_data = as_dataset(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    if checkpoint_every and not checkpoint_dir:
        raise MeshfitError("checkpoint_every needs checkpoint_dir=... (where to save)")

    engine = parallelize(
        model, plan, optimizer=optimizer, loss_fn=loss_fn, grad_clip=grad_clip,
        lr_scheduler=lr_scheduler, compile=compile,
        example_inputs=_pipeline_example(plan, train_data, batch_size),
    )  # fmt: skip
    if report_memory:
        engine.memory_report()  # measure gradients from the first step on
    dp_size, dp_rank = engine.dp_size, engine.dp_rank
    micro = engine.plan.num_microbatches
    check_batch_divides(batch_size, dp_size, micro)
    num_samples = _check_size(train_data, batch_size, "dataset")
    if eval_data is not None:
        _check_size(eval_data, batch_size, "eval_dataset")
    steps_per_epoch = num_samples // batch_size
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch

    history_path = history_file or (
        os.path.join(checkpoint_dir, "history.jsonl") if checkpoint_dir else None
    )
    run_config = {"batch_size": batch_size, "seed": seed, "num_samples": num_samples,
                  "shuffle": shuffle}  # fmt: skip
    start_step, records = 0, []
    resumed_from = None
    if checkpoint_dir and resume and latest_checkpoint(checkpoint_dir):
        meta = engine.load(checkpoint_dir)
        resumed_from = meta["path"]
        start_step = _check_resume(meta, run_config, resumed_from)
        _restore_rng(meta.get("rank_state"))
        records = _read_history(history_path, start_step)
    else:
        # Different ranks draw different dropout masks, as separate processes would.
        torch.manual_seed(seed + engine.rank)
        random.seed(seed + engine.rank)

    display = TrainingDisplay(total_steps, start_step, enabled=progress and engine.rank == 0)
    _announce(display, engine, model, batch_size, steps_per_epoch, total_steps, resumed_from)
    if engine.rank == 0 and history_path:
        _rewrite_history(history_path, records)

    loader = DataLoader(
        train_data,
        batch_sampler=GlobalBatchSampler(
            num_samples, batch_size, dp_size=dp_size, dp_rank=dp_rank, seed=seed,
            start_step=start_step, stop_step=total_steps, shuffle=shuffle,
        ),
        num_workers=num_workers,
        pin_memory=engine.device.type == "cuda",
        # Its own generator: a DataLoader otherwise draws a seed from the global RNG when
        # it starts, which would shift the model's dropout stream after a resume.
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    callbacks = list(callbacks)
    pending: list[tuple[int, torch.Tensor, float]] = []  # losses not yet read from device
    unsaved: list[dict[str, Any]] = []  # records not yet in the history file
    tokens_per_sample = None
    last_log_time, last_log_step = time.perf_counter(), start_step
    run_start = time.perf_counter()

    def flush(step: int, log_line: bool) -> dict[str, Any] | None:
        """Read pending losses from the device (one sync per log interval)."""
        nonlocal last_log_time, last_log_step
        if not pending:
            return None
        values = torch.stack([loss for _, loss, _ in pending]).tolist()
        for (s, _, lr), value in zip(pending, values, strict=True):
            if not math.isfinite(value):
                raise MeshfitError(
                    f"the loss became {value} at step {s}; lower the learning rate, set "
                    f"grad_clip=1.0, or use precision='bf16' instead of 'fp16'"
                )
            record = {"step": s, "loss": value, "lr": lr,
                      "time": round(time.perf_counter() - run_start, 4)}  # fmt: skip
            records.append(record)
            unsaved.append(record)
        pending.clear()
        now = time.perf_counter()
        rate = (step - last_log_step) * batch_size / max(now - last_log_time, 1e-9)
        last_log_time, last_log_step = now, step
        last = records[-1]
        last["samples_per_s"] = round(rate, 2)
        status = f"loss {last['loss']:.4f} | {format_rate(rate)} samples/s"
        if tokens_per_sample:
            last["tokens_per_s"] = round(rate * tokens_per_sample, 1)
            status += f" | {format_rate(rate * tokens_per_sample)} tok/s"
        if report_memory:
            memory = engine.memory_report()
            last["memory"] = memory
            state = sum(v for k, v in memory.items() if k != "peak_device" and v)
            status += f" | model state {state / 2**20:.1f} MiB/rank"
            if memory["peak_device"] is not None:
                status += f", peak {memory['peak_device'] / 2**30:.2f} GiB"
        display.update(step, status, log_line=log_line)
        return last

    try:
        step = start_step
        for inputs, targets in loader:
            if tokens_per_sample is None:
                tokens_per_sample = _tokens_per_sample(inputs)
            loss = engine.step_local(inputs, targets)
            step += 1
            pending.append((step, loss, engine.optimizer.param_groups[0].get("lr", 0.0)))
            at_end = step == total_steps
            if step % log_every == 0 or at_end:
                flush(step, log_line=True)
            paused = time.perf_counter()  # eval and saves do not count against throughput
            if eval_data is not None and (at_end or (eval_every and step % eval_every == 0)):
                flush(step, log_line=False)
                eval_loss = _evaluate(engine, eval_data, batch_size, eval_batches, num_workers)
                records[-1]["eval_loss"] = eval_loss
                display.print(f"step {step}: eval loss {eval_loss:.4f}")
            if checkpoint_dir and (at_end or (checkpoint_every and step % checkpoint_every == 0)):
                flush(step, log_line=False)
                if engine.rank == 0 and history_path:
                    _append_history(history_path, unsaved)
                unsaved.clear()
                _save(engine, checkpoint_dir, step, run_config, keep_checkpoints)
            last_log_time += time.perf_counter() - paused
            for callback in callbacks:
                callback(step, engine)
        flush(step, log_line=False)
    finally:
        display.close()
    if engine.rank == 0 and history_path:
        _append_history(history_path, unsaved)
    elapsed = time.perf_counter() - run_start
    if records and step > start_step:
        summary = f"done: {step - start_step} steps in {format_duration(elapsed)}, final loss {records[-1]['loss']:.4f}"
        if "eval_loss" in records[-1]:
            summary += f", eval loss {records[-1]['eval_loss']:.4f}"
        display.print(summary)
    return History(records, engine=engine)


# ---- pieces ----------------------------------------------------------------------


def as_dataset(data: Any, what: str) -> Dataset:
    """A map-style Dataset from a Dataset or an (inputs, targets) pair of tensors."""
    if isinstance(data, IterableDataset):
        raise MeshfitError(
            f"{what} is an IterableDataset; fit needs a map-style dataset (with __len__ "
            f"and __getitem__) so it can give each rank its own samples and resume exactly"
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


def _check_args(batch_size, max_steps, epochs, log_every, checkpoint_every, eval_every) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise MeshfitError(f"batch_size must be a positive whole number, not {batch_size!r}")
    if (max_steps is None) == (epochs is None):
        raise MeshfitError("give fit either max_steps=N or epochs=N (exactly one of them)")
    for name, value in (("max_steps", max_steps), ("epochs", epochs), ("log_every", log_every),
                        ("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):  # fmt: skip
        if value is not None and (not isinstance(value, int) or value < 1):
            raise MeshfitError(f"{name} must be a positive whole number, not {value!r}")


def _pipeline_example(plan: Any, data: Dataset, batch_size: int) -> Any:
    """One micro-batch of inputs for a pipeline plan to time its blocks on (so its
    stages are balanced by measured cost); None for other plans."""
    plan = as_plan(plan)
    if plan.pp == 1 or len(data) == 0:
        return None
    resolved = plan.with_dp_for(env_world_size()) if plan.dp is None else plan
    dp = resolved.data_parallel_size if resolved is not None else 1
    size = max(1, min(len(data), batch_size // (dp * plan.num_microbatches)))
    inputs, _ = unpack_batch(default_collate([data[i] for i in range(size)]))
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


def _tokens_per_sample(inputs: Any) -> int | None:
    """Token count per sample when inputs look like token ids (integers, [batch, seq])."""
    if isinstance(inputs, torch.Tensor) and inputs.ndim >= 2 and not inputs.is_floating_point():
        return int(math.prod(inputs.shape[1:]))
    return None


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
    losses = [engine.evaluate_local(x, y) for x, y in loader]
    return float(torch.stack(losses).mean())


def _save(engine: Engine, root: str, step: int, run_config: dict, keep: int) -> None:
    rank_state = {"torch_rng": torch.get_rng_state(), "python_random": random.getstate()}
    if engine.device.type == "cuda":
        rank_state["cuda_rng"] = torch.cuda.get_rng_state(engine.device)
    path = save_checkpoint(
        engine,
        os.path.join(root, step_dir_name(step)),
        extra={"fit": {"step": step, **run_config}},
        rank_state=rank_state,
    )
    point_latest(root, path)
    prune_checkpoints(root, keep)


def _check_resume(meta: dict, run_config: dict, path: str) -> int:
    saved = (meta.get("extra") or {}).get("fit")
    if saved is None:
        raise MeshfitError(
            f"{path!r} was saved by engine.save, not by fit, so it holds no data position; "
            f"load it with engine.load, or give fit a new checkpoint_dir"
        )
    for key, value in run_config.items():
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


def _read_history(path: str | None, up_to_step: int) -> list[dict]:
    if not path or not os.path.isfile(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                record = json.loads(line)
                if record["step"] <= up_to_step:
                    records.append(record)
    return records


def _rewrite_history(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def _append_history(path: str, records: list[dict]) -> None:
    if not records:
        return
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _announce(display, engine, model, batch_size, steps_per_epoch, total_steps, resumed_from):
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
    if resumed_from:
        display.print(f"meshfit: resumed from {resumed_from} (step {engine.step_count})")
