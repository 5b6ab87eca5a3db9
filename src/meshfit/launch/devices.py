"""What can be used here: the CPU and the visible GPUs, and how a selection becomes
CUDA_VISIBLE_DEVICES for the workers."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from meshfit.errors import MeshfitError


@dataclass(frozen=True)
class GPU:
    index: int  # index as the workers will see it (after CUDA_VISIBLE_DEVICES)
    name: str
    memory_bytes: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class Inventory:
    cpu_cores: int
    gpus: tuple[GPU, ...]
    cuda_visible_devices: str | None
    mps: bool = False  # an Apple GPU (Metal Performance Shaders) is there


def cpu_cores() -> int:
    """Cores this process may run on (honours taskset/cgroup affinity where it can)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def inventory() -> Inventory:
    """The CPU and every GPU visible to this process (CUDA_VISIBLE_DEVICES honoured,
    since torch.cuda itself only sees those)."""
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(
                GPU(
                    index=index,
                    name=props.name,
                    memory_bytes=props.total_memory,
                    capability=(props.major, props.minor),
                )
            )
    return Inventory(
        cpu_cores=cpu_cores(),
        gpus=tuple(gpus),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        mps=_mps_available(),
    )


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def parse_device_ids(spec: str | list[int] | tuple[int, ...] | None) -> list[int] | None:
    """Read "0,2" (or [0, 2]) into a list of GPU indices; None or "all" means all."""
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text in ("", "all"):
            return None
        if text == "cpu":
            return []
        try:
            ids = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise MeshfitError(
                f"cannot read devices {spec!r}: give GPU indices separated by commas "
                f"(e.g. --devices 0,2), 'all' or 'cpu'"
            ) from None
    else:
        ids = [int(i) for i in spec]
    if len(set(ids)) != len(ids):
        raise MeshfitError(f"devices {spec!r} names a GPU twice; name each GPU once")
    return ids


def select_devices(spec: str | list[int] | tuple[int, ...] | None) -> dict[str, str]:
    """Environment the workers need to use exactly the selected GPUs.

    Indices are those `meshfit devices` shows (i.e. relative to this process's own
    CUDA_VISIBLE_DEVICES). Returns {"CUDA_VISIBLE_DEVICES": ...} or {} for "all".
    An index that does not exist is an error listing those that do.
    """
    ids = parse_device_ids(spec)
    if ids is None:
        return {}
    if ids == []:
        return {"CUDA_VISIBLE_DEVICES": ""}
    available = inventory().gpus
    valid = [gpu.index for gpu in available]
    unknown = [i for i in ids if i not in valid]
    if unknown:
        have = ", ".join(str(i) for i in valid) if valid else "none (no GPU is visible here)"
        raise MeshfitError(
            f"no GPU with index {', '.join(map(str, unknown))}; the GPUs here are: {have}. "
            f"Run `meshfit devices` to list them"
        )
    # Map our indices back through an existing CUDA_VISIBLE_DEVICES, so that a user who
    # already restricted visibility gets the physical devices they see listed.
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:
        physical = [p.strip() for p in parent.split(",") if p.strip()]
        names = [physical[i] for i in ids]
    else:
        names = [str(i) for i in ids]
    return {"CUDA_VISIBLE_DEVICES": ",".join(names)}


def worker_device() -> torch.device:
    """The device a worker process trains on: its own GPU (by LOCAL_RANK) or the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise MeshfitError(
                f"worker with local rank {local_rank} has no GPU of its own (only {count} "
                f"visible); start at most {count} processes per node or select more devices"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def format_inventory(inv: Inventory) -> list[tuple[str, str, str, str]]:
    """Rows (device, name, memory, detail) for `meshfit devices`."""
    rows = [("cpu", "CPU", "-", f"{inv.cpu_cores} cores")]
    if inv.mps:
        # Listed so a Mac user sees it was found; torch.distributed has no process-group
        # backend for MPS, so meshfit's workers train on the CPU there.
        rows.append(("mps", "Apple GPU (Metal)", "shared", "found; meshfit trains on the CPU here"))
    for gpu in inv.gpus:
        rows.append(
            (
                f"cuda:{gpu.index}",
                gpu.name,
                f"{gpu.memory_bytes / 2**30:.1f} GiB",
                f"compute capability {gpu.capability[0]}.{gpu.capability[1]}",
            )
        )
    return rows
