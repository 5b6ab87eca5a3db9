"""Checkpoints on torch.distributed.checkpoint (DCP): atomic commit, resume, safety.

Layout of one checkpoint directory:

    <dir>/.metadata, __*_*.distcp   DCP: model and optimizer, under the model's own names
    <dir>/meshfit.json               what was saved: model fingerprint, plan, step, ...
    <dir>/ranks/rank-00000.pt        per-rank state (RNG), tensors only

A checkpoint is written into `<dir>.partial` and renamed into place only when every rank
has finished, so a crash during a save leaves the previous checkpoint whole; a failed
write (a full disk) stops the save on every rank with one MeshfitError and removes the
partial directory (io_agreement.py). A checkpoint root (what `fit` writes) holds
`step-00000100/` directories and a `latest` file naming the newest committed one,
replaced atomically.

Safety: DCP would unpickle its metadata and any non-tensor values with full pickle. We
read metadata with an allow-listed unpickler and non-tensor values with
`torch.load(weights_only=True)` (meshfit/state/safe_dcp.py), so a checkpoint from elsewhere
cannot run code. DCP itself is imported only when a checkpoint is written or read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.launch.process_group import is_distributed
from meshfit.state.state_hooks import OwnHooks

FORMAT = "meshfit-checkpoint/1"
META_FILE = "meshfit.json"
OPTIMIZER_LAYOUT = "flat"  # see _state_dict_options
LATEST_FILE = "latest"
PARTIAL_SUFFIX = ".partial"
STEP_PREFIX = "step-"


# ---- what a model is -------------------------------------------------------------


def model_fingerprint(model: nn.Module) -> dict[str, list]:
    """Name -> [shape, dtype] of every tensor in the model's state dict (global shapes,
    the user's own names): what a checkpoint must match to load into this model."""
    return {
        name: [list(t.shape), str(t.dtype).removeprefix("torch.")]
        for name, t in model.state_dict().items()
        if isinstance(t, torch.Tensor)
    }


def fingerprint_digest(fingerprint: dict[str, list]) -> str:
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def explain_mismatch(saved: dict[str, list], here: dict[str, list]) -> str | None:
    """None when the two fingerprints match; else what differs, briefly."""
    missing = [k for k in saved if k not in here]
    extra = [k for k in here if k not in saved]
    changed = [k for k in saved if k in here and saved[k][0] != here[k][0]]
    if not (missing or extra or changed):
        return None
    parts = []
    if changed:
        k = changed[0]
        parts.append(
            f"{len(changed)} tensor(s) have other shapes (e.g. {k!r}: {tuple(saved[k][0])} "
            f"in the checkpoint, {tuple(here[k][0])} here)"
        )
    if missing:
        parts.append(f"{len(missing)} are missing here (e.g. {missing[0]!r})")
    if extra:
        parts.append(f"{len(extra)} are not in the checkpoint (e.g. {extra[0]!r})")
    return "; ".join(parts)


# ---- finding checkpoints ---------------------------------------------------------


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def latest_checkpoint(root: str) -> str | None:
    """The newest committed checkpoint under a root written by `fit`, or None."""
    pointer = os.path.join(root, LATEST_FILE)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        candidate = os.path.join(root, name)
        if name and is_checkpoint(candidate):
            return candidate
    # No (or a stale) pointer: fall back to the highest committed step directory.
    steps = _committed_steps(root)
    return os.path.join(root, steps[-1]) if steps else None


def _step_dirs(root: str) -> tuple[list[str], list[str]]:
    """(committed, stale) step directory names under `root`, oldest first: stale are the
    leftovers of a crashed save (`.partial`) or replace (`.old`)."""
    if not os.path.isdir(root):
        return [], []
    names = sorted(n for n in os.listdir(root) if n.startswith(STEP_PREFIX))
    stale = [n for n in names if n.endswith((PARTIAL_SUFFIX, ".old"))]
    committed = [n for n in names if n not in stale and is_checkpoint(os.path.join(root, n))]
    return committed, stale


def _committed_steps(root: str) -> list[str]:
    return _step_dirs(root)[0]


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory itself, or the newest intact one under a checkpoint root
    (a damaged one is skipped with a warning naming its files)."""
    if is_checkpoint(path):
        _refuse_damaged(path)
        return path
    found = latest_checkpoint(path)
    if found:
        return _newest_intact(path, found)
    if not os.path.exists(path):
        raise MeshfitError(f"no checkpoint at {path!r}: the path does not exist")
    raise MeshfitError(
        f"no checkpoint at {path!r}: it holds no {META_FILE} and no committed "
        f"{STEP_PREFIX}* directory (an interrupted save leaves only *{PARTIAL_SUFFIX})"
    )


def _damage(checkpoint: str) -> list[str]:
    from meshfit.state.integrity import damaged_files

    recorded = read_meta(checkpoint).get("files")
    return damaged_files(checkpoint, recorded) if recorded is not None else []


def _refuse_damaged(checkpoint: str) -> None:
    damaged = _damage(checkpoint)
    if damaged:
        raise MeshfitError(
            f"checkpoint {checkpoint!r} is damaged: {', '.join(damaged)} do(es) not match "
            f"the checksum recorded when it was saved (a torn write or a disk error); load "
            f"an older checkpoint, or give the checkpoint root to take the newest intact one"
        )


def _newest_intact(root: str, newest: str) -> str:
    """`newest`, or the newest committed step under `root` whose files all verify."""
    older = [os.path.join(root, n) for n in reversed(_committed_steps(root))]
    for candidate in [newest] + [c for c in older if c != newest]:
        damaged = _damage(candidate)
        if not damaged:
            return candidate
        warnings.warn(
            f"skipping damaged checkpoint {candidate!r}: {', '.join(damaged)} do(es) not "
            f"match the checksum recorded at save; trying an older one",
            stacklevel=4,
        )
    raise MeshfitError(
        f"every checkpoint under {root!r} is damaged (their files do not match the "
        f"checksums recorded at save); nothing was loaded. Start over with resume=False or "
        f"a new checkpoint directory"
    )


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


# ---- save ------------------------------------------------------------------------


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save/load without a process group that it 'assumes a single
    process', which is exactly what no_dist=True asks for."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_rank0() -> bool:
    return not is_distributed() or dist.get_rank() == 0


@dataclass
class TrainingState:
    """The parts of a run a checkpoint saves and restores, handed over as they are (as
    torchtitan hands its checkpointer Stateful objects), not the engine that holds them."""

    model: nn.Module  # what runs forward: wrapped, sharded, this rank's stages
    optimizer: torch.optim.Optimizer
    scaler: Any  # torch.amp.GradScaler, or None
    lr_scheduler: Any  # a torch LR scheduler, or None
    runner: Any  # runners.Runner: which state is this rank's to save, the pipeline cut
    fingerprint: dict[str, Any]  # the model's global shapes under its own names
    plan: Any  # the Plan it trained under
    step: int
    rank: int
    world_size: int
    own_hooks: OwnHooks  # the model's own state-dict hooks: set aside (state_hooks.py)


def save_checkpoint(
    state: TrainingState,
    path: str,
    *,
    extra: dict[str, Any] | None = None,
    rank_state: dict[str, Any] | None = None,
    latest_root: str | None = None,
) -> str:
    """Write the run's model, optimizer and progress (`state`) to the directory `path`.

    extra: JSON-able values stored once (e.g. fit's data position).
    rank_state: tensors/plain values stored per rank (e.g. RNG state).
    latest_root: after the commit, point `<latest_root>/latest` at `path` (fit's root).
    Every rank must call this (it is collective). Returns `path`.

    A disk that is full or fails (any OSError, on any rank, DCP's writes included) stops
    the save on every rank (io_agreement.py: the ranks agree after each step, so none is
    left waiting) with one MeshfitError naming the directory, the OS error and the fix;
    the unfinished `<path>.partial` is removed where the disk allows, and the previous
    checkpoint and `latest` are left as they were.
    """
    from meshfit.state.io_agreement import on_every_rank

    path = os.path.abspath(path)
    partial = path + PARTIAL_SUFFIX
    if os.path.exists(path) and not is_checkpoint(path) and os.listdir(path):
        raise MeshfitError(
            f"{path!r} exists and is not a meshfit checkpoint; refusing to overwrite it. "
            f"Save to a new or empty directory"
        )
    extra_json = _json_or_error(extra, "extra")
    existed = os.path.exists(path)
    what = f"checkpoint {path!r}"

    def prepare() -> None:
        if _is_rank0():
            shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
            os.makedirs(partial)

    def write() -> None:
        import torch.distributed.checkpoint as dcp  # here: importing DCP costs ~1.5 s
        from torch.distributed.checkpoint.state_dict import get_state_dict

        options = _state_dict_options(OPTIMIZER_LAYOUT)
        with state.own_hooks.set_aside():  # the modules' own names (state_hooks.py)
            model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=options)
        # each key from the rank that owns it: DCP would keep any one rank's copy of a
        # replicated key, and a later stage's copy of a BatchNorm before the blocks holds
        # statistics of stand-in weights (loading still fills every rank's copy)
        model_sd = state.runner.owned_state(model_sd)
        if state.plan.tp > 1:  # fused q|k|v split per chunk: saved whole
            from meshfit.parallel.tensor import strided_as_replicated

            model_sd, optim_sd = strided_as_replicated([model_sd, optim_sd])
        with _single_process_quiet():
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=partial,
                no_dist=not is_distributed(),
            )
        if rank_state is not None:
            os.makedirs(os.path.join(partial, "ranks"), exist_ok=True)
            torch.save(rank_state, os.path.join(partial, "ranks", f"rank-{state.rank:05d}.pt"))

    def hash_my_share() -> dict[str, str]:
        from meshfit.state.integrity import checkpoint_files, share_digests

        return share_digests(partial, checkpoint_files(partial, skip=(META_FILE,)))

    def commit(files: dict[str, str]) -> None:
        if not _is_rank0():
            return
        _write_json_atomic(os.path.join(partial, META_FILE), _meta(state, extra_json, files))
        _commit(partial, path)
        if latest_root is not None:
            try:
                point_latest(latest_root, path)
            except OSError:
                if not existed:  # nothing names it: all or nothing
                    shutil.rmtree(path, ignore_errors=True)
                raise
        from meshfit.launch.markers import note_checkpoint

        note_checkpoint(os.path.abspath(path), state.step)  # for `meshfit run`'s stop line

    try:
        on_every_rank(prepare, what)
        on_every_rank(write, what)
        shares = on_every_rank(hash_my_share, what)
        files = {name: digest for share in shares for name, digest in share.items()}
        on_every_rank(lambda: commit(files), what)
    except BaseException:
        if _is_rank0():  # what the failed save left; the next save removes it otherwise
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return path


def _meta(state: TrainingState, extra_json: Any, files: dict[str, str]) -> dict[str, Any]:
    """What meshfit.json records of a checkpoint."""
    return {
        "format": FORMAT,
        "step": state.step,
        "plan": str(state.plan),
        # under pp: the first block of every stage (a resume says when its cut differs)
        "pipeline_cut": state.runner.pipeline_cut,
        "world_size": state.world_size,
        "model": state.fingerprint,
        "model_digest": fingerprint_digest(state.fingerprint),
        "optimizer": type(state.optimizer).__name__,
        "optimizer_layout": OPTIMIZER_LAYOUT,
        "scaler": state.scaler.state_dict() if state.scaler else None,
        "lr_scheduler": _json_or_error(
            state.lr_scheduler.state_dict() if state.lr_scheduler else None,
            "lr_scheduler state",
        ),
        "extra": extra_json,
        "files": files,  # xxh3-64 of every file, verified on load (integrity.py)
        "torch": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _commit(partial: str, path: str) -> None:
    """Move the finished checkpoint into place. When replacing an older checkpoint at
    the same path, the old one is renamed aside first and removed only afterwards (and
    put back if the new one cannot be moved in)."""
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    try:
        os.rename(partial, path)
    except OSError:
        if os.path.exists(old) and not os.path.exists(path):
            os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(path))


def point_latest(root: str, checkpoint: str) -> None:
    """Atomically make `root/latest` name `checkpoint` (rank 0 only)."""
    if not _is_rank0():
        return
    tmp = os.path.join(root, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(checkpoint) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST_FILE))


def prune_checkpoints(root: str, keep: int) -> None:
    """Keep the newest `keep` committed step directories; drop stale partial ones (a
    save that crashed leaves `<step>.partial`, a replace that crashed `<step>.old`).
    Called after a commit, so no save of this run is writing one."""
    if not _is_rank0() or keep < 1:
        return
    committed, stale = _step_dirs(root)
    for name in stale + committed[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- load ------------------------------------------------------------------------


def read_meta(checkpoint: str) -> dict[str, Any]:
    with open(os.path.join(checkpoint, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise MeshfitError(
            f"{checkpoint!r} has checkpoint format {meta.get('format')!r}; this meshfit "
            f"reads {FORMAT!r}"
        )
    return meta


def load_checkpoint(state: TrainingState, path: str) -> dict[str, Any]:
    """Load the checkpoint at `path` (or the newest under it) into the run's parts
    (`state`; its step is the caller's to take from the metadata's "step").

    Works under any plan of the same model (DCP reshards). Refuses, before touching the
    run, a checkpoint of another model or one saved with another optimizer type.
    Returns the checkpoint's metadata, plus "path" and, where this rank saved one,
    "rank_state".
    """
    checkpoint = resolve_checkpoint(path)
    meta = read_meta(checkpoint)
    mismatch = explain_mismatch(meta["model"], state.fingerprint)
    if mismatch:
        raise MeshfitError(
            f"checkpoint {checkpoint!r} was saved from a different model: {mismatch}. Load "
            f"it into the model it was saved from, or use a new checkpoint directory"
        )
    here = type(state.optimizer).__name__
    if meta["optimizer"] != here:
        raise MeshfitError(
            f"checkpoint {checkpoint!r} holds {meta['optimizer']} state but this engine "
            f"uses {here}; use the same optimizer to resume, or a new checkpoint directory"
        )
    saved_scheduler = meta.get("lr_scheduler") is not None
    if saved_scheduler != (state.lr_scheduler is not None):  # DCP failed on initial_lr
        raise MeshfitError(
            f"checkpoint {checkpoint!r} was saved {'with' if saved_scheduler else 'without'} "
            f"an lr_scheduler and this engine has {'none' if saved_scheduler else 'one'}; "
            f"resume with the same lr_scheduler setting, or use a new checkpoint directory"
        )
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # Checkpoints before the flat layout keep the nested one (they load as before).
    options = _state_dict_options(meta.get("optimizer_layout", "nested"))
    with state.own_hooks.set_aside():  # the modules' own names (state_hooks.py)
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer, options=options)
        loaded = _read_dcp(checkpoint, {"model": model_sd, "optim": optim_sd}, state.plan.tp > 1)
        set_state_dict(
            state.model,
            state.optimizer,
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optim"],
            options=options,
        )
    if state.scaler is not None and meta["scaler"]:  # fp32/bf16 -> fp16 starts it fresh
        state.scaler.load_state_dict(meta["scaler"])
    if state.lr_scheduler is not None and meta["lr_scheduler"]:
        state.lr_scheduler.load_state_dict(meta["lr_scheduler"])

    meta["path"] = checkpoint
    rank_file = os.path.join(checkpoint, "ranks", f"rank-{state.rank:05d}.pt")
    if meta["world_size"] == state.world_size and os.path.isfile(rank_file):
        meta["rank_state"] = torch.load(rank_file, weights_only=True)
    return meta


# ---- helpers ---------------------------------------------------------------------


def _state_dict_options(layout: str) -> Any:
    """DCP's state-dict options for an optimizer layout. "flat" keys every optimizer
    value by its parameter's name (state.<fqn>.exp_avg, param_groups.<fqn>.lr), as
    torchtitan saves them: pipeline ranks hold different parameters, and the nested
    layout's param_groups (one list per rank under the same keys) collided in the file,
    so a pipeline run resumed with another rank's hyper-parameters (AdamW: KeyError
    'betas' at the first step after resuming)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=layout == "flat")


def _json_or_error(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise MeshfitError(f"{what} must be JSON-serialisable to be checkpointed: {exc}") from None


def _write_json_atomic(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def gather_full_state(
    model: nn.Module, distributed: bool, runner: Any, own_hooks: OwnHooks
) -> dict[str, torch.Tensor]:
    """The whole model's state as full CPU tensors, on every rank, as the user's
    model.state_dict() gives it: each rank's full-tensor state dict (tensor-parallel and
    FSDP shards gathered by torch's get_model_state_dict) under the modules' own names,
    the pipeline stages merged by the runner, then the model's own saving hooks run."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from meshfit.parallel.placements import full_tensor

    with own_hooks.set_aside():
        local = model.state_dict() if not distributed else get_model_state_dict(model)
    # each shard's full tensor, one at a time (placements.full_tensor: DTensor's own is
    # wrong for FSDP2 over a chunk-by-chunk tp split)
    local = {
        k: (full_tensor(v) if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in local.items()
    }
    whole = runner.gather_state(local)
    return own_hooks.run_saving_hooks(whole) if own_hooks.saving else whole


def _read_dcp(checkpoint: str, state: dict[str, Any], strided: bool) -> dict[str, Any]:
    """`state` (a dict of state dicts) read from `checkpoint`'s DCP files, each rank
    reading only the pieces of the tensors it holds, whatever plan saved them; returned
    as DCP filled it: tensors in place, values that are not (an optimizer's step count,
    its param groups' settings) in the returned tree only. DCP's metadata goes through
    the allow-list first: a file that would run code is refused with a plain message
    rather than deep inside dcp.load. `strided`: tensor parallel split fused projections
    chunk by chunk, which are saved whole, so they are read whole and each rank keeps its
    chunks (parallel/tensor/state.py)."""
    import torch.distributed.checkpoint as dcp

    from meshfit.state.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    SafeFileSystemReader(checkpoint).read_metadata()
    pairs: list = []
    target: Any = state
    if strided:
        from meshfit.parallel.tensor import strided_as_replicated

        target = strided_as_replicated(state, pairs)
    with _single_process_quiet():
        dcp.load(
            target,
            storage_reader=SafeFileSystemReader(checkpoint),
            planner=SafeLoadPlanner(),
            no_dist=not is_distributed(),
        )
    if pairs:
        from meshfit.parallel.tensor import copy_back_strided

        return copy_back_strided(target, pairs)
    return target


def holds_checkpoint(path: str) -> bool:
    """Whether `path` is a meshfit checkpoint, or a root (fit's checkpoint_dir) with one."""
    return os.path.isdir(path) and (is_checkpoint(path) or latest_checkpoint(path) is not None)


def load_model_weights(
    model: nn.Module, path: str, fingerprint: dict[str, list], strided: bool
) -> str:
    """weights= from a meshfit checkpoint: the model's values only (no optimizer state,
    no step: resuming is `load`'s), read by DCP, which reads each rank only the pieces of
    the tensors it holds (its shards, its stages), whatever plan saved them. `model` is
    the split model; `fingerprint` the user's model as built (model_fingerprint).
    `strided`: tensor parallel split fused projections chunk by chunk (state.py).
    Returns the checkpoint directory read."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    checkpoint = resolve_checkpoint(path)  # checksums verified
    meta = read_meta(checkpoint)
    mismatch = explain_mismatch(meta["model"], fingerprint)
    if mismatch:
        raise MeshfitError(
            f"weights={path!r} is a checkpoint of a different model: {mismatch}; give the "
            f"weights of this model (a checkpoint it saved, or its safetensors)"
        )
    model_sd = get_model_state_dict(model)
    loaded = _read_dcp(checkpoint, {"model": model_sd}, strided)
    set_model_state_dict(model, loaded["model"])
    return checkpoint
