"""Checkpoints of a run and the exact resume from them: what is saved beside the model
(data position, RNG state, the run's configuration), and what a resume checks and
reports.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from meshfit.engine import Engine
from meshfit.errors import MeshfitError
from meshfit.launch import watchdog
from meshfit.launch.elastic import world_change
from meshfit.state.checkpoint import (
    latest_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_dir_name,
)
from meshfit.training.history import HistoryFile
from meshfit.training.log import StepLog


@dataclass(frozen=True)
class RunConfig:
    """The settings that fix the data order: a run resumes only with the same ones."""

    batch_size: int
    seed: int
    num_samples: int
    shuffle: bool


@dataclass
class Start:
    """Where a run begins: step 0, or the step of the checkpoint it resumed from (with
    the history records up to that step)."""

    step: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None  # the path resumed from
    changes: list[str] = field(default_factory=list)  # what differs from the checkpoint
    # Elastic runs: every resume into another world size so far (WorldChange records),
    # kept in each checkpoint so the last run's History lists them all.
    world_changes: list[dict[str, Any]] = field(default_factory=list)


def resume_run(
    engine: Engine, checkpoint_dir: str | None, config: RunConfig, history: HistoryFile
) -> Start:
    """Continue the run saved in `checkpoint_dir` if it holds a checkpoint: load the engine,
    restore this rank's RNG and read the history up to that step. Otherwise seed a new
    run: each data shard and pipeline stage its own seed, so they draw different dropout
    masks, as separate processes would; the ranks of a tensor-parallel group one seed,
    as they compute the same replicated activations (Topology.random_stream)."""
    if checkpoint_dir and latest_checkpoint(checkpoint_dir):
        wanted = hyperparameters(engine.optimizer)
        meta = engine.load(checkpoint_dir)
        step = check_resume(meta, config, meta["path"])
        changes = keep_new_hyperparameters(engine, wanted, meta["path"])
        if meta.get("plan") != str(engine.plan):
            changes.append(f"plan {meta.get('plan')} -> {engine.plan} (resharded)")
        cut = engine.runner.pipeline_cut
        if "pipeline_cut" in meta and meta["pipeline_cut"] != cut:  # older checkpoints lack it
            changes.append(f"pipeline cut {cut_text(meta['pipeline_cut'])} -> {cut_text(cut)}")
        if meta.get("rank_state"):
            restore_rng(meta["rank_state"])
        elif meta.get("world_size") != engine.world_size:
            # another world size: rank streams cannot map one to one; seeded anew, from
            # the seed, the step and the stream together (no two of them share a seed)
            mixed = hash((config.seed, step, engine.topology.random_stream)) & 0x7FFFFFFF
            seed_streams(mixed, 0)
        world_changes = list((meta.get("extra") or {}).get("world_changes", []))
        change = world_change(meta, engine.plan, engine.world_size, checkpoint_dir)
        if change is not None:
            changes.append(change.describe())
            world_changes.append(change.as_record())
        return Start(step, history.read(step), meta["path"], changes, world_changes)
    seed_streams(config.seed, engine.topology.random_stream)
    return Start()


def seed_streams(seed: int, stream: int) -> None:
    """Seed this rank's torch and Python RNGs: `stream` is shared by a tensor-parallel
    group (Topology.random_stream)."""
    torch.manual_seed(seed + stream)
    random.seed(seed + stream)


def cut_text(starts: list[int] | None) -> str:
    """A pipeline cut as the first block of each stage ("none" without pp)."""
    return "stages from blocks " + ", ".join(map(str, starts)) if starts else "none"


def save_step(
    engine: Engine,
    root: str,
    step: int,
    config: RunConfig,
    keep: int,
    history: HistoryFile,
    log: StepLog,
    world_changes: list[dict[str, Any]] | None = None,
) -> None:
    """Append the history, save a checkpoint of `step` (with this rank's RNG state), point
    `latest` at it and keep the newest `keep`. A full or failing disk stops the run on
    every rank with a MeshfitError (io_agreement.py); `latest` still names the previous
    checkpoint, the resume point."""
    from meshfit.state.io_agreement import on_every_rank

    on_every_rank(lambda: history.append_new(log.records), f"the history file {history.path!r}")
    rank_state = {"torch_rng": torch.get_rng_state(), "python_random": random.getstate()}
    if engine.device.type == "cuda":
        rank_state["cuda_rng"] = torch.cuda.get_rng_state(engine.device)
    with watchdog.phase("save", f"the save of the step-{step} checkpoint", step=step):
        save_checkpoint(
            engine.training_state(),
            os.path.join(root, step_dir_name(step)),
            extra={
                "fit": {"step": step, **asdict(config)},
                **planned_extra(engine),
                **({"world_changes": world_changes} if world_changes else {}),
            },
            rank_state=rank_state,
            latest_root=root,
        )
        prune_checkpoints(root, keep)


def planned_extra(engine: Engine) -> dict[str, Any]:
    """plan="auto": the planner's choice and prediction, kept in the checkpoint."""
    return {"planned": engine.planned.as_record()} if engine.planned is not None else {}


def check_resume(meta: dict, config: RunConfig, path: str) -> int:
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


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, weight_decay, betas, ...)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def keep_new_hyperparameters(engine: Engine, wanted: list[dict[str, Any]], path: str) -> list[str]:
    """Loading a checkpoint restores the optimizer's settings too, so a run resumed with
    another learning rate would silently train on with the old one. This run's settings
    win, and each change is listed ("lr 0.001 -> 0.0003"). With an lr_scheduler, whose
    saved state would set the learning rate again, a change is refused instead."""
    loaded = hyperparameters(engine.optimizer)
    changes = []
    for index, (new, old) in enumerate(zip(wanted, loaded, strict=False)):
        group = f" (group {index})" if len(wanted) > 1 else ""
        for key, value in new.items():
            if key == "lr" and engine.lr_scheduler is not None:
                continue  # the schedule's own value by now; its start is initial_lr
            if key in old and not same_value(old[key], value):
                changes.append(f"{key} {shown_value(old[key])} -> {shown_value(value)}{group}")
                engine.optimizer.param_groups[index][key] = value
    if changes and engine.lr_scheduler is not None:
        raise MeshfitError(
            f"cannot resume from {path!r} with other optimizer settings ({'; '.join(changes)}) "
            f"under an lr_scheduler, whose saved state would set the learning rate again; "
            f"resume with the checkpoint's settings, or give fit a new checkpoint_dir (or "
            f"resume=False) to start over"
        )
    return changes


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def shown_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return f"{value:g}" if isinstance(value, float) else str(value)


def restore_rng(rank_state: dict | None) -> None:
    if not rank_state:
        return  # another world size: RNG streams cannot map one to one
    torch.set_rng_state(rank_state["torch_rng"])
    state = rank_state["python_random"]
    random.setstate((state[0], tuple(state[1]), state[2]))
    if "cuda_rng" in rank_state and torch.cuda.is_available():
        torch.cuda.set_rng_state(rank_state["cuda_rng"])
