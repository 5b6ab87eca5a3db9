"""One-line errors from workers started by `meshfit run`.

A MeshfitError is the user's to fix, so a worker prints it as one line instead of a
traceback and exits with status 2. When several ranks hit the same error, the first to
claim a marker file prints it and the others stay silent. The launcher's marker
directory also holds a marker per worker a hang verdict killed (`note_killed`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from meshfit.errors import MeshfitError

EXIT_USER_ERROR = 2


MARKER_DIR_ENV = "MESHFIT_MARKER_DIR"  # set by the launcher, which removes it at the end


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


KILLED_MARKER_PREFIX = "killed-by-hang-verdict-"


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


def _hook(exc_type, exc, tb) -> None:  # noqa: ANN001 - sys.excepthook's signature
    from meshfit import watchdog

    watchdog.wait_if_stopping()
    timeout_line = watchdog.explain_collective_timeout(exc)
    if timeout_line is not None:
        print(f"meshfit: error: {timeout_line}", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        os._exit(watchdog.EXIT_HANG)
    from meshfit.elastic import lost_peer_line

    lost = lost_peer_line(exc)
    if lost is not None:
        print(f"meshfit: {lost}", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        os._exit(1)  # a failure: the agent restarts the workers in the re-formed group
    if issubclass(exc_type, MeshfitError):
        # The real stderr: torch's own excepthook (installed by init_process_group)
        # wraps this one and buffers sys.stderr until we return, which we never do.
        if _claim_report():
            print(f"meshfit: error: {exc}", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_USER_ERROR)
    sys.__excepthook__(exc_type, exc, tb)


def install() -> None:
    if os.environ.get("MESHFIT_WORKER") == "1":
        sys.excepthook = _hook
