"""Warm worker starts: `mf.launch` forks its workers from a server process that has
already imported torch, meshfit and the libraries this process uses, instead of starting
each as a fresh Python that imports them all again.

Measured on the 2-core VM: a fresh worker spends seconds importing before it runs a line
of the user's function (torch ~1 s idle, 4.6 s beside other work; transformers ~1.3 s
more), and `mf.launch` of a function that returns 1 took 2.0 s with 2 workers and 3.5 s
with 4 on an idle machine (9.4 s and 14.9 s beside other work). BENCHMARKS.md has the
warm figures.

How: Python's `forkserver` start method (torch's elastic agent starts the workers with
it, as it does with spawn). The server is started once per process, with a preload list
(`wanted_preload`): torch, meshfit, and every module of the libraries named in
`LIBRARIES` that this process has imported when the server starts. When a later launch
wants more (transformers was imported since), the server is started again, once. CUDA
is never touched in the server: importing torch does not initialise it, and the server
only imports.

What a worker gets is what a spawned worker gets, so nothing leaks between launches:
- a new process, forked from the server, never from a worker: no process group, no
  mesh, no CUDA context, meshfit's module state as imported;
- the environment of this process at the launch (with the launcher's RANK, WORLD_SIZE,
  ...), not the server's (`WorkerStart.apply`; the server keeps the one it started with);
- this process's stdout and stderr at the launch (the server's may be a file a test
  captured long ago), its working directory, sys.path and sys.argv (multiprocessing's
  preparation data, as under spawn); variables read only as a process starts (glibc's
  MALLOC_*, LD_PRELOAD, PYTHONHASHSEED, OMP_* ...) start the server again when they
  changed since it started;
- fresh random states: Python's `random` is reseeded by the fork itself, torch's and
  numpy's default generators here from fresh entropy, as a new process's import seeds
  them (the server's would be the same in every worker and every launch).
tests/test_launch.py checks each of these.

MESHFIT_WARM_START=0 turns it off (workers spawned fresh, as before); `meshfit run` uses
it with MESHFIT_WARM_START=1 only (run_command._run_workers says why).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

WARM_ENV = "MESHFIT_WARM_START"
PRELOAD_ENV = "MESHFIT_PRELOAD"  # the modules the server imports (read by this module)

# Always imported in the server: what every worker imports before the user's function.
ALWAYS = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.api",
    "meshfit",
)

# Libraries whose imported modules the server imports too: what a worker would import
# again to run a model of theirs (a transformers model's module, FSDP2, DTensor, the
# pipelining schedules). Packages that start threads when imported stay out: a fork
# keeps only the forking thread.
LIBRARIES = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "transformers",
    "diffusers",
    "peft",
    "timm",
    "torchvision",
    "safetensors",
    "numpy",
    "xxhash",
    "cloudpickle",
)

# The variables torch's elastic agent sets for each worker (its _start_workers and
# start_processes): they win over this process's environment.
AGENT_KEYS = frozenset(
    {
        "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCHELASTIC_ERROR_FILE",
    }
)  # fmt: skip

_lock = threading.Lock()
_started: dict[str, Any] = {"preload": None, "env": None}


def enabled(default: bool = True) -> bool:
    """Whether workers start warm: MESHFIT_WARM_START=0 turns it off, =1 on; unset,
    `default` (mf.launch: on; meshfit run: off, run_command._run_workers says why)."""
    value = os.environ.get(WARM_ENV)
    if value is None or value == "":
        return default
    return value.lower() not in ("0", "false", "no", "off")


def start_method() -> str:
    return "forkserver" if enabled() else "spawn"


def wanted_preload() -> tuple[str, ...]:
    """What the server should import: ALWAYS, and this process's imported modules of
    the LIBRARIES (private ones and the compilers' left out: torch._dynamo and
    torch._inductor start work of their own when used)."""
    found = set()
    for name in list(sys.modules):
        if any(name == lib or name.startswith(lib + ".") for lib in LIBRARIES):
            parts = name.split(".")
            if not any(p.startswith("_") for p in parts[1:]) or name in LIBRARIES:
                found.add(name)
    return (*ALWAYS, *sorted(found))


def ensure_server() -> dict[str, str] | None:
    """The server running with the preload this process wants (started, or started
    again when it lacks a library imported here since); returns the environment it was
    started with (the workers' base, see WorkerStart). None when warm starts are off.

    A new module of a library the server has (another transformers model, say) does not
    start it again: the workers import that one themselves (a fraction of a second),
    where a new server imports everything again (seconds; measured in the suite, a
    restart per test that built another model family took more than it saved)."""
    if not enabled():
        return None
    from multiprocessing import forkserver

    wanted = wanted_preload()
    with _lock:
        server = forkserver._forkserver
        running = getattr(server, "_forkserver_pid", None) is not None
        have = _started["preload"]
        same_start = _read_at_start(os.environ) == _read_at_start(_started["env"] or {})
        if running and have is not None and _libraries(wanted) <= _libraries(have) and same_start:
            return _started["env"]
        if running and hasattr(server, "_stop"):
            server._stop()
        env = dict(os.environ)
        os.environ[PRELOAD_ENV] = ",".join(wanted)
        try:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["meshfit.launch.preload"])
            server.ensure_running()
        finally:
            os.environ.pop(PRELOAD_ENV, None)
        _started["preload"], _started["env"] = wanted, env
        return env


def _libraries(modules: tuple[str, ...]) -> set[str]:
    """The LIBRARIES among `modules`' packages."""
    return {lib for lib in LIBRARIES for m in modules if m == lib or m.startswith(lib + ".")}


# Variables a process reads as it starts or loads its libraries (glibc's malloc, the
# dynamic loader, Python's hash seed and allocator, the OpenMP / BLAS runtimes torch
# loads at import): a forked worker has the server's values, so the server is started
# again when this process's differ from those it started with.
_AT_START = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "PYTHONHASHSEED", "PYTHONMALLOC", "OMP_",
             "KMP_", "MKL_", "OPENBLAS_", "TORCH_")  # fmt: skip


def _read_at_start(environ: Any) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(_AT_START)}


@dataclass
class WorkerStart:
    """What a warm worker sets up before the user's function, to start as a spawned one
    would: this process's environment and standard streams as they are when the agent
    starts the worker (made when the start is pickled, as spawn's child would inherit
    them then: the rendezvous handler sets variables on this process before each round's
    workers start)."""

    base: dict[str, str]  # the server's environment (what the worker inherited)
    environ: dict[str, str] | None = None  # this process's, at the worker's start
    streams: list[Any] = field(default_factory=list)  # fds 1 and 2, at the worker's start

    def __reduce__(self) -> tuple:
        streams: list[Any] = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:
                streams.append(None)
            else:
                streams.append(_Stream(fd))
        return (WorkerStart, (self.base, dict(os.environ), streams))

    def apply(self) -> None:
        """In the worker: the launch's environment (with what the launcher set for this
        worker), the launch's stdout and stderr, fresh numpy random state."""
        given = {k: v for k, v in os.environ.items() if k in AGENT_KEYS or self.base.get(k) != v}
        os.environ.clear()
        os.environ.update({**(self.environ or {}), **given})
        for target, stream in zip((1, 2), self.streams, strict=False):
            if stream is not None:
                stream.install(target)
        # fresh entropy, as a new process draws at import (forked, every worker would
        # share the server's state, launch after launch); Python's `random` is reseeded
        # by the fork itself
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()


class _Stream:
    """A file descriptor of this process for the worker: multiprocessing's DupFd, made
    when the worker's start is pickled (then the fd travels over the server's socket
    with the process), put in place of the worker's fd 1 or 2."""

    def __init__(self, fd: int, handle: Any = None) -> None:
        self.fd, self.handle = fd, handle

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_Stream, (self.fd, DupFd(self.fd)))

    def install(self, target: int) -> None:
        stream = sys.stdout if target == 1 else sys.stderr
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - nothing written yet
            pass
        fd = self.handle.detach()
        os.dup2(fd, target)
        os.close(fd)
