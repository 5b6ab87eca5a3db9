"""The watchdog's verdict on a hang: which ranks are stuck (frozen, busy in the script, in
user code inside a step, behind, or all in one collective) and the one line that says
so, from each rank's published state (watchdog.py publishes them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass

EXITED = "exited"  # the kind a rank publishes when its script has ended


@dataclass(frozen=True)
class RankState:
    """One rank's heartbeat record in the store."""

    rank: int
    beat: int
    seq: int
    step: int
    kind: str
    doing: str
    waiting: bool
    stalled_s: float
    host: str
    pid: int
    # Where the main thread is: the innermost frame of user code ("loss (train.py:9)"),
    # and whether that is the innermost frame at all (user code runs, or blocks in a
    # call of its own) rather than meshfit's or torch's (a collective, a kernel).
    frame: str = ""
    in_user_code: bool = False
    waits_in: str = ""  # the innermost frame of meshfit's, when it is there
    collective: str = ""  # the torch.distributed call the main thread is in, if any
    # Whether the main thread computes: it used most of the time since the last heartbeat
    # on a CPU. A collective, a sleep or any blocking call waits off the CPU; a loop that
    # does not end keeps it busy (its frame alone cannot tell: a tight loop is sampled at
    # the same bytecode each time). This tells "every rank waits for a collective" from
    # "every rank computes in a loop of its own".
    computing: bool = False
    # The engine call the rank is in ("save_model", "evaluate"): one that every rank must
    # make together, whose fix, when a peer ended its script, is "not under a rank guard".
    call: str = ""


def frozen_ranks(
    first: dict[int, RankState], second: dict[int, RankState], world_size: int, me: int
) -> list[int]:
    """The ranks besides `me` whose heartbeat did not move between two reads of the
    store some beats apart, or that vanished from it; not those that exited."""
    return [
        r
        for r in range(world_size)
        if r != me
        and (r not in second or (r in first and first[r].beat == second[r].beat))
        and not (r in second and second[r].kind == EXITED)
    ]


_STDLIB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(contextlib.__file__)))


# the meshfit package (this module is in meshfit/launch/)
_MESHFIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def main_thread_place() -> tuple[str, bool, str, str]:
    """(innermost frame of user code as "function (file:line)", whether the main thread
    is in user code right now, meshfit's innermost frame as "function (file:line)", the
    torch.distributed call it is in when that is the innermost frame). Frames of the
    standard library (a sleep, a lock) count as their caller's; torch's and meshfit's
    are not the user's (a collective, the engine)."""
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    user, ours, innermost, collective = "", "", None, ""
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        kind = _kind_of(filename)
        if kind != "stdlib":
            where = f"{frame.f_code.co_name} ({os.path.basename(filename)}:{frame.f_lineno})"
            if innermost is None:
                innermost = kind
                if kind == "torch" and f"{os.sep}distributed{os.sep}" in filename:
                    collective = frame.f_code.co_name
            if kind == "user" and not user:
                user = where
            if kind == "meshfit" and not ours:
                ours = where
        frame = frame.f_back
    return user, innermost == "user", ours, collective


def main_thread_cpu_seconds() -> float | None:
    """The CPU time the main thread has used (Linux: its thread CPU clock); None where
    the platform cannot say."""
    try:
        main = threading.main_thread().ident
        return time.clock_gettime(time.pthread_getcpuclockid(main))  # type: ignore[arg-type]
    except (AttributeError, OSError, OverflowError, TypeError):
        return None


def _kind_of(filename: str) -> str:
    if filename.startswith(_MESHFIT_DIR):
        return "meshfit"
    if f"{os.sep}torch{os.sep}" in filename or f"{os.sep}site-packages{os.sep}torch" in filename:
        return "torch"
    if filename.startswith(_STDLIB_DIR) and "site-packages" not in filename:
        return "stdlib"
    return "user"


def stuck_ranks(states: dict[int, RankState], frozen: list[int], world_size: int) -> list[int]:
    """Who holds the others up (the rules in the module docstring)."""
    if frozen:
        return frozen
    busy = [r for r, s in states.items() if not s.waiting]
    if busy:
        return busy
    # Inside a step every rank is marked waiting; one running user code (its forward,
    # its loss, a callback) while the others wait in meshfit or torch holds them up.
    in_user = [r for r, s in states.items() if s.in_user_code]
    if in_user and len(in_user) < len(states):
        return in_user
    waiting = [s for s in states.values() if s.waiting]
    furthest = max((s.step, s.kind) for s in waiting)
    behind = [s.rank for s in waiting if (s.step, s.kind) != furthest]
    return behind or list(range(world_size))


def describe(states: dict[int, RankState], frozen: list[int], world_size: int, where: str) -> str:
    """The one line a hang is reported with."""
    stuck = stuck_ranks(states, frozen, world_size)
    waiters = sorted(r for r, s in states.items() if s.waiting and r not in stuck)
    if len(stuck) == world_size and not frozen:
        what = _everyone_stuck(states, stuck)
    else:
        parts = []
        for r in stuck:
            s = states.get(r)
            if r in frozen:
                if s is None:  # frozen (or still importing) before its watchdog started
                    parts.append(
                        f"rank {r} never sent a heartbeat (the process is frozen or stopped, "
                        f"or still starting)"
                    )
                else:
                    parts.append(
                        f"rank {r} stopped responding (no heartbeat: the process is frozen "
                        f"or stopped, last seen in {s.doing})"
                    )
            elif s.kind == EXITED:
                parts.append(f"rank {r} has exited (its script ended)")
            elif s.in_user_code and s.waiting:  # how long: the waiters say (below)
                parts.append(f"rank {r} is in {s.frame}, inside {s.doing}")
            elif s.collective and not s.waiting:  # the script's own collective
                parts.append(
                    f"rank {r} waits in {s.collective} called by {s.frame or 'its script'} "
                    f"outside a step, which its peers do not call (mismatched calls across "
                    f"ranks)"
                )
            else:
                inside = f" (in {s.frame})" if s.frame and s.in_user_code else ""
                parts.append(f"rank {r} has been in {s.doing}{inside} for {s.stalled_s:.0f} s")
        who = "rank" if len(waiters) == 1 else "ranks"
        verb = "waits" if len(waiters) == 1 else "wait"
        place = {states[r].waits_in for r in waiters} if waiters else set()
        at = f" in {place.pop()}" if len(place) == 1 and "" not in place else ""
        waited = max((states[r].stalled_s for r in waiters), default=0.0)
        in_user = any(r in states and states[r].in_user_code for r in stuck)
        took = f" ({waited:.0f} s so far)" if in_user else ""
        wait = f"; {who} {', '.join(map(str, waiters))} {verb} for it{at}{took}" if waiters else ""
        alone = _called_alone(states, stuck, waiters)
        if alone:  # not slow, not a fault: neither a restart nor a longer timeout helps
            return f"hang detected: {'; '.join(parts)}{wait}{alone}"
        what = "; ".join(parts) + wait
    return (
        f"hang detected: {what}. Python stacks of the live ranks: {where}/rank-*.txt. "
        f"With --max-restarts the job restarts from the last checkpoint; if the phase is "
        f"just slow, raise --hang-timeout (now {_timeout():.0f} s; 0 turns it off)"
    )


def _called_alone(states: dict[int, RankState], stuck: list[int], waiters: list[int]) -> str:
    """The fix, when the ranks holding the others up have ended their scripts while the
    others wait in an engine call: it was called on some ranks only (a rank guard)."""
    if not waiters or not all(r in states and states[r].kind == EXITED for r in stuck):
        return ""
    call = states[waiters[0]].call  # marked by the engine's method, not read from words
    if not call:
        return ""
    return (
        f": {collective_call(call)}, not under a rank guard such as `if engine.rank == 0:`; "
        f"call it on every rank"
    )


def collective_call(call: str) -> str:
    """What an engine call under a rank guard must be told: the hang verdict's (a peer
    ended its script) and watchdog.explain_one_sided_call's (a peer's connection closed)."""
    return (
        f"engine.{call} is called by every rank together (each rank gives its part; a file "
        f"is written once, by rank 0)"
    )


def _everyone_stuck(states: dict[int, RankState], stuck: list[int]) -> str:
    """Every rank is held where it is: the stacks say whether they wait for one another
    (a collective) or each computes in a loop that does not end, and whose loop it is."""
    s = states[stuck[0]]
    every = [states[r] for r in stuck]
    if all(t.computing and not t.collective for t in every):
        if all(t.in_user_code for t in every):
            frames = sorted({t.frame for t in every})
            return (
                f"every rank is computing in {', '.join(frames)} inside {s.doing}, in no "
                f"collective, and none has returned for {s.stalled_s:.0f} s: the script's "
                f"or model's own code does not end (a loop, or work slower than the hang "
                f"timeout)"
            )
        frames = sorted({t.waits_in or t.frame for t in every})
        return (
            f"every rank is computing in meshfit's own {', '.join(frames)} during {s.doing}, "
            f"in no collective, and none has left it for {s.stalled_s:.0f} s: a loop in "
            f"meshfit that does not end. This is a meshfit bug; please report it with the "
            f"stacks below, and meanwhile try another plan"
        )
    calls = {t.collective for t in every}
    call = f" ({calls.pop()})" if len(calls) == 1 and "" not in calls else ""
    return (
        f"every rank waits in {s.doing} and none has progressed for "
        f"{s.stalled_s:.0f} s: a collective{call} does not complete (mismatched calls "
        f"across ranks, or a network fault)"
    )


def _timeout() -> float:
    return hang_timeout()


HANG_TIMEOUT_ENV = "MESHFIT_HANG_TIMEOUT_S"


DEFAULT_HANG_TIMEOUT_S = 120.0


def hang_timeout() -> float:
    raw = os.environ.get(HANG_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_HANG_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        from meshfit.errors import MeshfitError

        raise MeshfitError(
            f"{HANG_TIMEOUT_ENV} must be a number of seconds (0 turns hang detection off), "
            f"not {raw!r}"
        )
    return value
