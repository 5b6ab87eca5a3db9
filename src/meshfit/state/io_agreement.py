"""File writes that every rank agrees on: a disk error on one rank stops all of them.

A checkpoint is written by every rank, and between the writes the ranks wait for each
other. If one rank's write fails (disk full, an I/O error) and only that rank raises, the
others wait in the next collective until the launcher's timeout. So each step of a save
runs through `on_every_rank`: the ranks gather whether their part worked (the gather
also orders the steps, as a barrier did) and, if any failed, all of them raise the same
error. DCP's own writes agree the same way: it gathers every rank's result and raises a
CheckpointException (a BaseException) on every rank, with the failing ranks' exceptions.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from meshfit.errors import MeshfitError
from meshfit.launch.process_group import is_distributed

T = TypeVar("T")

# What to do about an OSError, by errno; anything else: check the disk.
_ADVICE = {
    errno.ENOSPC: "free space on that filesystem",
    errno.EDQUOT: "free space within your disk quota",
    errno.EROFS: "make that filesystem writable",
    errno.EACCES: "make that directory writable",
    errno.EPERM: "make that directory writable",
}


class RankFailed(RuntimeError):
    """Another rank's step of a save failed with an error that is not the user's to fix."""


def on_every_rank(action: Callable[[], T], what: str) -> list[T]:
    """Run `action` on this rank; return every rank's result (rank order) when it worked
    on all of them. Otherwise raise on every rank: a MeshfitError naming `what` and the
    OS error when a rank's failure was an OSError (the user can fix a full disk), the
    failing rank's MeshfitError as it is, and for any other failure the failing rank's
    own exception there and RankFailed on the others.

    Collective: every rank must call it, in the same order."""
    result: Any = None
    failure: BaseException | None = None
    try:
        result = action()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        failure = exc
    except BaseException as exc:
        if type(exc).__name__ != "CheckpointException":  # KeyboardInterrupt, SystemExit
            raise
        failure = exc
    mine = (result, _summary(failure))
    if is_distributed():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    failed = [(rank, summary) for rank, (_, summary) in enumerate(every) if summary]
    if not failed:
        return [part for part, _ in every]
    rank, summary = next(((r, s) for r, s in failed if s["errno"] is not None), failed[0])
    if summary["errno"] is not None:
        rank = summary["rank"] if summary["rank"] is not None else rank
        raise MeshfitError(_os_message(what, rank, summary)) from failure
    if summary["type"] == "MeshfitError":
        raise MeshfitError(summary["message"]) from failure
    if failure is not None:
        raise failure
    raise RankFailed(f"rank {rank} failed while writing {what}: {summary['message']}")


def _summary(failure: BaseException | None) -> dict[str, Any] | None:
    """What the other ranks need to know of a failure (picklable, small)."""
    if failure is None:
        return None
    rank, os_error = find_os_error(failure)
    if os_error is not None:
        return {
            "rank": rank,  # where DCP gathered it from; None: this rank
            "type": type(os_error).__name__,
            "errno": os_error.errno,
            "message": os_error.strerror or str(os_error),
            "filename": os_error.filename,
        }
    return {
        "rank": None,
        "type": type(failure).__name__,
        "errno": None,
        "message": " ".join(f"{type(failure).__name__}: {failure}".split())[:500],
        "filename": None,
    }


def find_os_error(exc: BaseException) -> tuple[int | None, OSError | None]:
    """(rank, the OSError behind `exc`): itself (rank None: this one), one DCP gathered
    from a rank (CheckpointException keeps {rank: (exception, traceback)}), or one in its
    cause/context chain; (None, None) when there is none."""
    seen: set[int] = set()
    todo: list[tuple[int | None, BaseException | None]] = [(None, exc)]
    while todo:
        rank, current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return rank, current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [(r, pair[0]) for r, pair in failures.items() if isinstance(pair, tuple)]
        todo += [(rank, current.__cause__), (rank, current.__context__)]
    return None, None


def _os_message(what: str, rank: int, summary: dict[str, Any]) -> str:
    where = f" ({summary['filename']})" if summary["filename"] else ""
    ranks = f" on rank {rank}" if is_distributed() else ""
    advice = _ADVICE.get(summary["errno"], "check the disk")
    return (
        f"could not write {what}: {summary['message']}{where}{ranks}; the previous "
        f"checkpoint and the 'latest' pointer are unchanged and the unfinished files "
        f"are removed. {advice[0].upper()}{advice[1:]} or save to another directory "
        f"(fit's checkpoint_dir=, meshfit demo --checkpoint-dir), then resume"
    )
