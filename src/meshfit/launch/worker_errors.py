"""One-line errors from workers started by `meshfit run`.

A MeshfitError is the user's to fix, so a worker prints it as one line instead of a
traceback and exits with status 2. When several ranks hit the same error, the first to
claim a marker file prints it and the others stay silent. The launcher's marker
directory (markers.py) also holds a marker per worker a hang verdict killed.
"""

from __future__ import annotations

import os
import sys

from meshfit.errors import MeshfitError
from meshfit.launch.markers import _claim_report, note_raised

EXIT_USER_ERROR = 2


def _hook(exc_type, exc, tb) -> None:  # noqa: ANN001 - sys.excepthook's signature
    from meshfit.launch import watchdog

    watchdog.wait_if_stopping()
    timeout_line = watchdog.explain_collective_timeout(exc)
    if timeout_line is not None:
        print(f"meshfit: error: {timeout_line}", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        os._exit(watchdog.EXIT_HANG)
    from meshfit.launch.elastic import lost_peer_line

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
    note_raised(exc)
    sys.__excepthook__(exc_type, exc, tb)


def install() -> None:
    if os.environ.get("MESHFIT_WORKER") == "1":
        sys.excepthook = _hook
