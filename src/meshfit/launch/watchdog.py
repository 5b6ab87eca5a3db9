"""Hang detection: a stuck rank is named within the hang timeout, not after 30 minutes.

Every rank of a multi-process job runs a daemon thread that publishes a heartbeat to the
launcher's store through its own client connection (never through the collective that
may be stuck), and records what the rank is doing: `mark(...)` is called by the engine at
each training step, evaluation, save and load. A rank that is *waiting* (inside one of
those, where it needs its peers) and has made no progress for the hang timeout, or whose
neighbour's heartbeat stopped, asks the store for every rank's state and decides who is
stuck (hang_verdict.py):

- a rank whose heartbeat stopped: the process is frozen or stopped (SIGSTOP, a hung
  driver call) - it is killed if it runs on this host, since it cannot exit by itself;
- else ranks outside any waiting phase: busy in the training script (its loop, its own
  data loading) while their peers wait for them;
- else, inside a phase, ranks whose main thread runs user code (the model's forward, the
  loss, a metric: the innermost frame outside the standard library is neither torch's
  nor meshfit's) while the others wait in meshfit or torch: named with that frame;
- else ranks that wait in an earlier step or another phase than the rest;
- else every rank: all wait in the same phase, so a collective never completes.

The first rank to decide publishes one verdict; every live rank writes its Python stack
(`faulthandler`, all threads) into the hang directory and exits with EXIT_HANG, so the
launcher restarts the job from the last checkpoint when --max-restarts allows. The
deciding rank prints one meshfit line naming the stuck rank(s), the step, what they were
doing and where the stacks are.

Legitimately long phases: start-up gets at least SETUP_FLOOR_S, and a phase may take up
to 3x the longest phase of the same kind seen on this rank before the timeout applies (so
a slow first step does not make every later step suspect, and a save that took 4 minutes
last time may take 12 now). A collective's own timeout (MESHFIT_TIMEOUT_S, gloo/NCCL) is
reported the same way by `explain_collective_timeout`.

The end of a run: a rank whose script ended publishes that it exited (`stop`), and a
peer on the same host whose process is gone is skipped too, so their silence is not
taken for a freeze while another rank works on alone.

Set the timeout with `meshfit run --hang-timeout S`, `mf.launch(..., hang_timeout=S)` or
MESHFIT_HANG_TIMEOUT_S; 0 turns detection off. Store traffic: per rank and interval
(timeout / 10, between 0.2 and 5 s) one set, one check and one read of its neighbour's
heartbeat (a ring, so a frozen rank is seen even when nobody waits in a marked phase);
all ranks' keys are read only when a rank has stalled.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta

from meshfit.launch import markers
from meshfit.launch.hang_verdict import (  # noqa: F401
    DEFAULT_HANG_TIMEOUT_S,
    EXITED,
    HANG_TIMEOUT_ENV,
    RankState,
    collective_call,
    describe,
    frozen_ranks,
    hang_timeout,
    main_thread_cpu_seconds,
    main_thread_place,
    stuck_ranks,
)

HANG_DIR_ENV = "MESHFIT_HANG_DIR"
EXIT_HANG = 3  # the deciding rank printed the reason; the launcher adds nothing
PHASE_MARGIN = 3.0  # a phase may take this many times its kind's longest so far
# Start-up (imports, joining the group, building the model) waits for the slowest rank's
# start; 8 workers importing torch on 2 cores take over 10 s, so it gets at least this.
SETUP_FLOOR_S = 60.0


@dataclass(frozen=True)
class Mark:
    """What a rank is doing. `waiting`: inside a phase that needs its peers."""

    seq: int
    step: int
    kind: str  # "setup", "step", "evaluate", "save", "load", "script", "exited"
    doing: str
    waiting: bool
    call: str = ""  # the engine method every rank calls together, when in one


# `doing` is a noun phrase read after "in": "training step 3", "the training script after
# training step 2".
_SETUP = Mark(seq=0, step=0, kind="setup", doing="setup (process group, model)", waiting=True)
_current = _SETUP
_since = time.monotonic()  # when _current began (this process's start: see _forked)
_longest: dict[str, float] = {}  # kind -> longest completed duration on this rank
_lock = threading.Lock()
_dump_dir: str | None = None
_watchdog: _Watchdog | None = None
_inherited: list[_Watchdog] = []  # a forked child's parent's watchdog (see _forked)
# A main thread on a CPU for more than this share of the time between two heartbeats
# computes (hang_verdict.RankState.computing): a blocked one uses next to none, and a
# spinning one keeps at least this much of a core shared by two or three processes.
COMPUTING_SHARE = 0.25
# A main thread under this share over a whole heartbeat is off the CPU: blocked (a
# collective), not computing slowly. Waiting alone needs it: a rank still building its
# model or finishing its last optimizer step on a busy machine after its peers ended is
# not waiting for them (measured: a `meshfit run --plan fsdp=2` beside a 4-worker test was
# told "rank 1 waits for it in shard_part" while rank 1 ran fully_shard at a third of a
# core, 1 of 570 tests in a suite run).
IDLE_SHARE = 0.05
# How long a rank waits in a phase after every peer has exited before the verdict: the
# exits are published as they happen, so a few heartbeats are enough.
ALONE_GRACE_S = 3.0
_on_hang: Callable[[str], None] | None = None  # mf.launch records the line for the parent
# Set once a hang verdict is being carried out: the main thread, failing meanwhile in a
# collective whose peer just exited, leaves the report and the exit to the watchdog.
stopping = threading.Event()


def _forked() -> None:
    """In a forked child, start-up begins now, not when the parent imported meshfit: a
    worker forked from the warm server (launch/warm.py) inherited the server's clock,
    so once the server was older than the hang timeout every new worker's watchdog found
    its start-up stalled, diagnosed for 4 heartbeats (20 s) and kept its rank's exit
    waiting up to 10 s for the thread (measured: launches late in the test suite took
    10-25 s longer than the same launch on a fresh server)."""
    global _current, _since, _watchdog, _lock, stopping
    # a thread of the parent may have held these at the fork: new ones, not released ones
    _lock, stopping = threading.Lock(), threading.Event()
    _current = _SETUP
    _since = time.monotonic()
    _longest.clear()
    if _watchdog is not None:  # the parent's thread is not in the child; its store client
        _inherited.append(_watchdog)  # is kept, not destroyed here (a socket it shares)
    _watchdog = None


os.register_at_fork(after_in_child=_forked)


def mark(
    kind: str, doing: str, *, step: int | None = None, waiting: bool = True, call: str = ""
) -> None:
    """Record that this rank now does `doing` (cheap: no I/O; the thread publishes it);
    `call`: the engine method it is in, which every rank must call (hang_verdict says
    "not under a rank guard" when a peer ended its script meanwhile)."""
    global _current, _since
    now = time.monotonic()
    with _lock:
        previous = _current
        took = now - _since
        if took > _longest.get(previous.kind, 0.0):
            _longest[previous.kind] = took
        _current = Mark(
            seq=previous.seq + 1,
            step=previous.step if step is None else step,
            kind=kind,
            doing=doing,
            waiting=waiting,
            call=call,
        )
        _since = now


@contextlib.contextmanager
def phase(kind: str, doing: str, *, step: int | None = None, call: str = "") -> Iterator[None]:
    """Mark a waiting phase; when it ends this rank is back in the training script. An
    exception leaves the mark as it was, so a report says where the rank failed."""
    mark(kind, doing, step=step, call=call)
    yield
    mark("script", f"the training script after {doing}", waiting=False)


def set_dump_dir(path: str | None) -> None:
    """Where stacks of a hang go (fit: <checkpoint_dir>/hangs)."""
    global _dump_dir
    _dump_dir = path


def set_on_hang(callback: Callable[[str], None] | None) -> None:
    global _on_hang
    _on_hang = callback


STALE_HANG_DIR_S = 7 * 24 * 3600  # temp hang directories older than this are removed


def dump_dir() -> str:
    if _dump_dir:
        return os.path.join(_dump_dir, "hangs")
    if os.environ.get(HANG_DIR_ENV):
        return os.environ[HANG_DIR_ENV]
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return os.path.join(tempfile.gettempdir(), f"meshfit-hangs-{run}")


def remove_stale_hang_dirs(keep: str, now: float | None = None) -> list[str]:
    """Remove the temp directory's meshfit-hangs-* directories (a run's stacks, when it
    had no checkpoint directory) older than STALE_HANG_DIR_S, except `keep`: they piled
    up, one per run that hung. Returns what was removed."""
    import shutil

    now = time.time() if now is None else now
    removed = []
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith("meshfit-hangs-") or os.path.abspath(path) == os.path.abspath(keep):
            continue
        try:
            if now - os.path.getmtime(path) > STALE_HANG_DIR_S:
                shutil.rmtree(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def start(rank: int, world_size: int) -> None:
    """Start this process's watchdog (once) if the job has peers and a launcher store."""
    global _watchdog
    if _watchdog is not None or world_size < 2:
        return
    timeout = hang_timeout()
    if timeout == 0:
        return
    store = _store_client()
    if store is None:
        return
    _watchdog = _Watchdog(store, rank, world_size, timeout)
    _watchdog.start()
    atexit.register(stop)


def stop() -> None:
    """Stop the watchdog thread, publish that this rank exited (so its peers do not take
    its silence for a freeze) and drop the store connection before the interpreter exits,
    so no daemon thread is inside a TCPStore call while Python tears down. (The abort of
    finished workers seen in CI came from gloo's threads instead; `meshfit run` workers
    exit past teardown for it, meshfit/launch/boot.py.)"""
    global _watchdog
    watchdog, _watchdog = _watchdog, None
    if watchdog is None or watchdog is threading.current_thread():
        return
    mark(EXITED, "its exit (its script has ended)", waiting=False)
    watchdog.halt.set()
    watchdog.join(timeout=10)
    if not watchdog.is_alive():
        with contextlib.suppress(Exception):  # the store may be gone with the launcher
            watchdog._publish()
        watchdog.store = None


def attempt_id() -> str:
    """This restart attempt's name in the launcher's store, the same on every node: the
    rendezvous round where meshfit's rendezvous runs (a host started again counts its
    restarts from 0 while the others count 1), else torchrun's restart count."""
    return os.environ.get("MESHFIT_RDZV_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _store_client():  # noqa: ANN202 - torch.distributed.Store
    """A client connection of our own to the launcher's store, under this restart
    attempt's prefix (mesh._attempt_store explains the prefix)."""
    import torch.distributed as dist

    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    attempt = attempt_id()
    try:
        store = dist.TCPStore(
            host_name=os.environ["MASTER_ADDR"],
            port=int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=30),
        )
    except Exception:  # noqa: BLE001 - no store, no watchdog: training is unaffected
        return None
    return dist.PrefixStore(f"meshfit/attempt-{attempt}/watchdog/", store)


class _Watchdog(threading.Thread):
    def __init__(self, store, rank: int, world_size: int, timeout: float) -> None:  # noqa: ANN001
        super().__init__(name="meshfit-watchdog", daemon=True)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.interval = min(5.0, max(0.2, timeout / 10))
        self.beat = 0
        self.halt = threading.Event()
        self.host = socket.gethostname()
        self._neighbour, self._neighbour_beat = -1, -1
        self._neighbour_seen = time.monotonic()
        self._cpu = (time.monotonic(), main_thread_cpu_seconds())  # at the last heartbeat
        # How far round the ring the first rank that may still run is: a rank that has
        # exited stays exited within an attempt, so the walk never passes it again.
        self._skip = 1
        self._alone = False  # every other rank has exited (_neighbour_frozen finds it)
        self._idle = False  # the main thread was off the CPU over the last whole heartbeat

    def run(self) -> None:
        try:
            while True:
                state = self._publish()
                if self.store.check(["verdict"]):
                    self._obey(json.loads(self.store.get("verdict")))
                stalled = state.waiting and state.stalled_s > self._allowed(state.kind)
                if stalled or self._neighbour_frozen() or self._alone_waiting(state):
                    self._diagnose()
                if self.halt.wait(self.interval):
                    return
        except Exception:  # noqa: BLE001 - the store is gone (job ending): stop watching
            return

    def _alone_waiting(self, state: RankState) -> bool:
        """Waiting in a phase (a collective) while every other rank has ended its script:
        nothing can complete it, so say so now rather than after the hang timeout (a
        save under `if engine.rank == 0:` waited 120 s for a verdict). Only while the
        main thread is blocked (`_idle`): one that computes is not waiting for anybody,
        and the hang timeout still covers it."""
        return self._alone and self._idle and state.waiting and state.stalled_s > ALONE_GRACE_S

    def _publish(self) -> RankState:
        self.beat += 1
        state = self._own_state()
        self.store.set(f"rank/{self.rank}", json.dumps(asdict(state)))
        return state

    def _neighbour_frozen(self) -> bool:
        """Whether the next running rank's heartbeat has not changed for the hang timeout.
        Each rank watches one neighbour (a ring: O(world) store reads per interval), which
        catches a frozen rank even while this one is not inside a marked phase. Ranks
        that have exited, or whose process on this host is gone, are skipped: their
        silence is not a freeze."""
        while self._skip < self.world_size:
            neighbour = (self.rank + self._skip) % self.world_size
            key = f"rank/{neighbour}"
            if not self.store.check([key]):
                return False  # not started yet: setup is the launcher's to time out
            record = json.loads(self.store.get(key))
            if record["kind"] != EXITED and not self._gone(record):
                break
            self._skip += 1
        else:
            self._alone = True
            return False  # every other rank has exited
        now = time.monotonic()
        if (neighbour, record["beat"]) != (self._neighbour, self._neighbour_beat):
            self._neighbour, self._neighbour_beat = neighbour, record["beat"]
            self._neighbour_seen = now
            return False
        return now - self._neighbour_seen > self.timeout

    def _gone(self, record: dict) -> bool:
        """Whether a rank's process on this host has ended without saying so (os._exit
        skips `stop`); a rank on another host cannot be checked from here."""
        if record["host"] != self.host or record["pid"] == os.getpid():
            return False
        try:
            with open(f"/proc/{record['pid']}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def _own_state(self) -> RankState:
        with _lock:
            current, since = _current, _since
        frame, in_user_code, waits_in, collective = main_thread_place()
        now, cpu = time.monotonic(), main_thread_cpu_seconds()
        (then, before), self._cpu = self._cpu, (now, cpu)
        busy = None if cpu is None or before is None else (cpu - before) / max(now - then, 1e-3)
        computing = busy is not None and busy > COMPUTING_SHARE
        if now - then >= self.interval / 2:  # a diagnosis' second look is too short to tell
            self._idle = busy is None or busy < IDLE_SHARE
        return RankState(
            rank=self.rank,
            beat=self.beat,
            seq=current.seq,
            step=current.step,
            kind=current.kind,
            doing=current.doing,
            waiting=current.waiting,
            stalled_s=round(time.monotonic() - since, 1),
            host=self.host,
            pid=os.getpid(),
            frame=frame,
            in_user_code=in_user_code,
            waits_in=waits_in,
            collective=collective,
            computing=computing,
            call=current.call,
        )

    def _allowed(self, kind: str) -> float:
        floor = SETUP_FLOOR_S if kind == "setup" else 0.0
        return max(self.timeout, floor, PHASE_MARGIN * _longest.get(kind, 0.0))

    def _read_all(self) -> dict[int, RankState]:
        states = {}
        for rank in range(self.world_size):
            key = f"rank/{rank}"
            if self.store.check([key]):
                states[rank] = RankState(**json.loads(self.store.get(key)))
        return states

    def _diagnose(self) -> None:
        """Read every rank twice, some heartbeats apart, and publish who is stuck."""
        first = self._read_all()
        for _ in range(0 if self._alone else 4):  # keep beating: a peer may diagnose us too
            if self.halt.wait(self.interval):
                return  # stop() was called: this rank's script has ended
            self._publish()
        second = self._read_all()
        frozen = frozen_ranks(first, second, self.world_size, self.rank)
        own = self._own_state()
        if (
            not frozen
            and not (own.waiting and own.stalled_s > self._allowed(own.kind))
            and not self._alone_waiting(own)
        ):
            return  # progress was made meanwhile
        try:
            line = describe(second, frozen, self.world_size, dump_dir())
        except Exception as exc:  # noqa: BLE001 - a fault in the wording must not end detection
            line = (
                f"hang detected: rank {self.rank} has waited {own.stalled_s:.0f} s in "
                f"{own.doing}; unresponsive ranks: {frozen or 'none'} (meshfit could not "
                f"describe the ranks' states: {exc!r}). Python stacks: {dump_dir()}/rank-*.txt"
            )
        verdict = {
            "reporter": self.rank,
            "line": line,
            "frozen": [[r, second[r].host, second[r].pid] for r in frozen if r in second],
        }
        # Only the first verdict counts (compare_set sets a missing key when expected is "").
        self.store.compare_set("verdict", "", json.dumps(verdict))
        self._obey(json.loads(self.store.get("verdict")))

    def _obey(self, verdict: dict) -> None:
        """Write this rank's stack, report (the deciding rank), stop frozen local peers,
        and exit so the launcher can restart the job."""
        if verdict["reporter"] == self.rank and verdict.get("main_thread_reports"):
            return  # a collective timed out here: the main thread reports and exits
        stopping.set()
        if verdict["reporter"] == self.rank:
            if _on_hang is not None:
                _on_hang(verdict["line"])
            print(f"meshfit: error: {verdict['line']}", file=sys.__stderr__, flush=True)
        write_stack(self.rank)
        if verdict["reporter"] == self.rank:
            for _rank, host, pid in verdict["frozen"]:
                if host == self.host and pid != os.getpid():
                    markers.note_killed(pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)  # frozen: it cannot exit by itself
            if not self._alone:  # no peer left to write its stack
                time.sleep(2 * self.interval + 0.5)  # let stuck ranks write their stacks
        else:
            time.sleep(0.2)
        os._exit(EXIT_HANG)


def wait_if_stopping() -> None:
    """Called where an exception would be reported: under a hang verdict the watchdog
    thread reports and exits, so the (secondary) exception is not reported at all."""
    if stopping.is_set():
        time.sleep(60)  # the watchdog exits the process long before this ends


def write_stack(rank: int) -> str | None:
    """This process's Python stacks (all threads) into the hang directory."""
    where = dump_dir()
    path = os.path.join(where, f"rank-{rank}.txt")
    if os.path.dirname(os.path.abspath(where)) == os.path.abspath(tempfile.gettempdir()):
        remove_stale_hang_dirs(keep=where)
    try:
        os.makedirs(where, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"rank {rank}, pid {os.getpid()}, doing: {_current.doing}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
    except OSError:
        return None
    return path


def explain_collective_timeout(exc: BaseException) -> str | None:
    """The meshfit line for a gloo/NCCL collective timeout, naming the stuck rank(s) from
    the heartbeats when the watchdog runs; None for any other exception."""
    text = str(exc)
    if "Timed out" not in text and "timed out" not in text and "Timeout" not in text:
        return None
    if not any(w in text for w in ("gloo", "Gloo", "NCCL", "recv", "send", "collective")):
        return None
    first_line = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    watchdog = _watchdog
    who = ""
    if watchdog is not None:
        try:
            states = watchdog._read_all()
            time.sleep(watchdog.interval * 2 + 0.2)
            again = watchdog._read_all()
            frozen = frozen_ranks(states, again, watchdog.world_size, watchdog.rank)
            who = " " + describe(again, frozen, watchdog.world_size, dump_dir())
            write_stack(watchdog.rank)
            # The other live ranks write their stacks and exit too (the stuck one would
            # never reach a timeout of its own).
            verdict = {
                "reporter": watchdog.rank,
                "line": who,
                "frozen": [],
                "main_thread_reports": True,
            }
            watchdog.store.compare_set("verdict", "", json.dumps(verdict))
        except Exception:  # noqa: BLE001 - the store is gone too: report what we have
            who = ""
    with _lock:
        doing = _current.doing
    timeout = os.environ.get("MESHFIT_TIMEOUT_S", "1800")
    return (
        f"a collective timed out after {timeout} s (MESHFIT_TIMEOUT_S) while this rank was "
        f"in {doing}: {first_line}.{who}"
    )


def explain_one_sided_call(call: str, exc: BaseException) -> str | None:
    """The meshfit line for a collective engine call (save_model, save, evaluate,
    predict, full_state_dict) that failed because other ranks never called it (a rank
    guard, `if engine.rank == 0:`): which ranks were elsewhere, from their heartbeats.
    None when the peers were in the same call (another fault) or nothing is known."""
    watchdog = _watchdog
    if watchdog is None:
        return None
    try:
        states = watchdog._read_all()
    except Exception:  # noqa: BLE001 - no store: nothing to tell
        return None
    with _lock:
        doing = _current.doing
    elsewhere = []
    for rank in sorted(states):
        state = states[rank]
        if rank == watchdog.rank:
            continue
        if state.kind == EXITED:
            elsewhere.append(f"rank {rank} had ended its script")
        elif state.doing != doing:
            elsewhere.append(f"rank {rank} was in {state.doing}")
    if not elsewhere:
        return None
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    return (
        f"{collective_call(call)}, but rank {watchdog.rank} called it alone: "
        f"{'; '.join(elsewhere)} ({type(exc).__name__} here: {first}). Call engine.{call} "
        f"on every rank, without a rank guard such as `if engine.rank == 0:`"
    )
