"""The launcher's marker directory (`meshfit run` makes one per run and removes it at the
end): the first rank to claim a report prints a one-line error (worker_errors.py), and a
rank the hang verdict killed is marked (watchdog.py), so the launcher does not report
that death a second time."""

from __future__ import annotations

import contextlib
import os
import tempfile

MARKER_DIR_ENV = "MESHFIT_MARKER_DIR"  # set by the launcher, which removes it at the end
KILLED_MARKER_PREFIX = "killed-by-hang-verdict-"
RAISED_MARKER_PREFIX = "raised-"


def _claim_report() -> bool:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    name = f"meshfit-error-{os.getuid() if hasattr(os, 'getuid') else 0}-{run_id}-{attempt}"
    where = os.environ.get(MARKER_DIR_ENV) or tempfile.gettempdir()
    try:
        os.close(os.open(os.path.join(where, name), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def note_killed(pid: int) -> None:
    """Leave word for `meshfit run` that this pid dies by a hang verdict already
    reported: the launcher may see that death before the reporter's own exit, and would
    otherwise add "worker rank N failed (signal 9)" to the report."""
    where = os.environ.get(MARKER_DIR_ENV)
    if where:
        with contextlib.suppress(OSError):
            open(os.path.join(where, f"{KILLED_MARKER_PREFIX}{pid}"), "w").close()


def killed_by_verdict(marker_dir: str, pid: int) -> bool:
    return os.path.exists(os.path.join(marker_dir, f"{KILLED_MARKER_PREFIX}{pid}"))


def note_raised(exc: BaseException) -> None:
    """Leave word for `meshfit run` that this worker raised (Python prints its traceback
    and exits with status 1), so the launcher names the exception instead of calling it
    an exit without one."""
    where = os.environ.get(MARKER_DIR_ENV)
    if where:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        with (
            contextlib.suppress(OSError),
            open(os.path.join(where, f"{RAISED_MARKER_PREFIX}{os.getpid()}"), "w") as f,
        ):
            f.write(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


def raised_by(marker_dir: str, pid: int) -> str | None:
    """What worker `pid` raised ("RuntimeError: ..."), if it left word (note_raised)."""
    try:
        with open(os.path.join(marker_dir, f"{RAISED_MARKER_PREFIX}{pid}")) as f:
            return f.read()
    except OSError:
        return None


CHECKPOINT_MARKER = "newest-checkpoint"


def note_checkpoint(path: str, step: int) -> None:
    """Leave word for `meshfit run` of the newest committed checkpoint (rank 0, after each
    save): what a run stopped by a signal says it can resume from."""
    where = os.environ.get(MARKER_DIR_ENV)
    if where:
        with contextlib.suppress(OSError):
            with open(os.path.join(where, CHECKPOINT_MARKER + ".tmp"), "w") as f:
                f.write(f"{step}\n{path}")
            os.replace(
                os.path.join(where, CHECKPOINT_MARKER + ".tmp"),
                os.path.join(where, CHECKPOINT_MARKER),
            )


def newest_checkpoint(marker_dir: str) -> tuple[int, str] | None:
    """(step, path) of the newest checkpoint a worker committed in this run, if any."""
    try:
        with open(os.path.join(marker_dir, CHECKPOINT_MARKER)) as f:
            step, path = f.read().split("\n", 1)
        return int(step), path
    except (OSError, ValueError):
        return None
