"""Starting workers: `mf.launch(fn)` from Python and `meshfit run script.py` from a shell.

Both are thin layers over torch.distributed's elastic launcher (the engine of torchrun):
the elastic agent starts the workers, runs the rendezvous, restarts the group when a
worker dies (up to max_restarts) and tears every worker down when one fails, so a failure
never leaves the others hanging in a collective. The rendezvous is torch's dynamic one
over meshfit's backend (rendezvous.py: signed state, stores on one address); a single
node listens on loopback only (docs/security.md).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshfit.errors import MeshfitError
from meshfit.launch import rendezvous, stores, warm, watchdog
from meshfit.launch.devices import cpu_cores, select_devices
from meshfit.launch.process_group import shutdown_process_group

_ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
)


class WorkerError(RuntimeError):
    """A worker failed and its exception could not be rebuilt in this process."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class WorkerSetup:
    """How many workers, on what, with how many threads each."""

    nproc: int
    env: dict[str, str]
    device_kind: str  # "cuda" or "cpu"
    threads: int | None


def plan_workers(
    nproc: int | None, devices: str | Sequence[int] | None, threads: int | None
) -> WorkerSetup:
    """Choose the worker count and environment. nproc defaults to the selected GPUs, or
    to 2 CPU workers (1 when there is one core) with one intra-op thread each."""
    env = select_devices(devices)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpu_count = len([d for d in visible.split(",") if d])
    else:
        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc is not None and nproc < 1:
        raise MeshfitError(f"nproc must be at least 1, not {nproc}")
    if gpu_count:
        if nproc is None:
            nproc = gpu_count
        elif nproc > gpu_count:
            raise MeshfitError(
                f"{nproc} workers need {nproc} GPUs but {gpu_count} are selected; use "
                f"--nproc {gpu_count} or select more devices (meshfit devices lists them)"
            )
        kind = "cuda"
        if threads is None:
            threads = max(1, cpu_cores() // nproc)
    else:
        if nproc is None:
            nproc = 2 if cpu_cores() >= 2 else 1
        kind = "cpu"
        if threads is None:
            threads = 1
    if threads < 1:
        raise MeshfitError(f"threads must be at least 1, not {threads}")
    env["OMP_NUM_THREADS"] = str(threads)
    env["MESHFIT_THREADS"] = str(threads)
    env["MESHFIT_WORKER"] = "1"
    return WorkerSetup(nproc=nproc, env=env, device_kind=kind, threads=threads)


LOOPBACK = "127.0.0.1"


def loopback_env() -> dict[str, str]:
    """Keep gloo's and NCCL's own listening sockets of a single-node run on loopback:
    gloo binds the address its host name resolves to, which is not loopback in many
    containers and clusters."""
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_env(
    master: str, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """The workers' GLOO/NCCL_SOCKET_IFNAME for a multi-node run whose node 0 is at
    `master` (ADDR:PORT), and the line that says so (None when nothing was chosen).

    Left alone, gloo binds the address this host's name resolves to, which is loopback
    in many containers and network namespaces (/etc/hosts: 127.0.0.1 HOSTNAME): its
    peers on other hosts are then told to connect to 127.0.0.1 and the run fails
    ("Connection refused" in connectFullMesh, measured on torch 2.13 between two
    namespaces). The interface that holds this node's address on the route to node 0 is
    one every node can reach. A variable the user set is kept."""
    environ = os.environ if environ is None else environ
    missing = [name for name in IFNAME_ENVS if not environ.get(name)]
    if not missing:
        return {}, None
    addr, _, port = master.rpartition(":")
    found = stores.interface_towards(addr.strip("[]"), int(port) if port.isdigit() else 1)
    if found is None:
        return {}, None
    name, local = found
    chosen = " and ".join(n.split("_")[0].lower() for n in missing)
    line = (
        f"meshfit: {chosen} will use {name} ({local}, the interface towards {addr}); set "
        f"{'/'.join(missing)} to choose another"
    )
    return dict.fromkeys(missing, name), line


@contextlib.contextmanager
def _patched_environ(updates: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_elastic_logs(level: int) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, saved, strict=True):
            lg.setLevel(old)


# ---- Python entry point ------------------------------------------------------------


def launch(
    fn: Callable[..., Any],
    nproc: int | None = None,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    devices: str | Sequence[int] | None = None,
    max_restarts: int = 0,
    threads: int | None = None,
    hang_timeout: float | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` in `nproc` local worker processes and return rank 0's
    result.

    Each worker is a new process with RANK/WORLD_SIZE/... set, so `mf.parallelize`
    inside `fn` joins the group by itself. Workers are forked from a server that has
    imported torch, meshfit and the libraries this process uses (launch/warm.py: after
    the first launch they start in about a second; each still starts as a spawned
    process would, with this process's environment and streams and no state of an
    earlier launch); MESHFIT_WARM_START=0 spawns fresh interpreters instead. `fn` may be defined in a
    module, or where workers cannot import it (a notebook cell, `python -c`, a script
    read from stdin, a lambda or a nested function): it is then sent by value with
    cloudpickle, with its arguments and the globals it uses. If a worker
    raises, the same exception type is raised here with the worker's rank and traceback
    attached; if a worker dies (signal, exit), a WorkerError says which one. A rank that
    makes no progress for `hang_timeout` seconds (default 120, 0: off) while its peers
    wait stops the job with a MeshfitError naming it (watchdog.py).
    """
    if _importing_main_in_a_worker():
        _refuse_unguarded_main()
    _refuse_an_unguarded_call()
    if not callable(fn):
        raise MeshfitError(f"launch needs a function to run, not {fn!r}")
    if max_restarts < 0:
        raise MeshfitError(f"max_restarts must be >= 0, not {max_restarts}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    setup = plan_workers(nproc, devices, threads)
    setup.env.update(hang_timeout_env(hang_timeout))
    base = warm.ensure_server()  # before this launch's variables are set
    error_dir = tempfile.mkdtemp(prefix="meshfit-launch-")
    secret = rendezvous.new_secret()
    rendezvous.register()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=setup.nproc,
        run_id=rendezvous.run_id(secret),
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"{LOOPBACK}:0",  # a free port, listening on loopback only
        local_addr=LOOPBACK,  # MASTER_ADDR of the workers' store
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver" if base is not None else "spawn",
    )
    call = (fn, tuple(args), dict(kwargs or {}))
    if sends_by_value(fn):
        call = (ByValue.of(*call), (), {})
    try:
        with (
            _patched_environ({**setup.env, **loopback_env(), ERROR_DIR_ENV: error_dir}),
            rendezvous.using_secret(secret),
            _quiet_elastic_logs(logging.CRITICAL),
            _main_without_phantom_file(),
        ):
            start = warm.WorkerStart(base) if base is not None else None
            results = elastic_launch(config, _worker_main)(*call, error_dir, start)
    except ChildFailedError as failed:
        raise _rebuild_worker_exception(error_dir, failed) from None
    finally:
        os.environ.pop(rendezvous.ROUND_ENV, None)  # set by the handler for the workers
        shutil.rmtree(error_dir, ignore_errors=True)
    return results[0]


def sends_by_value(fn: Callable[..., Any]) -> bool:
    """Whether spawned workers could not import `fn` by its name: defined in a __main__
    with no file to run again (a notebook, `python -c`, a script on stdin), or a lambda
    or a function nested in another."""
    qualname = getattr(fn, "__qualname__", "")
    return (getattr(fn, "__module__", None) == "__main__" and not _main_has_file()) or any(
        part in qualname for part in ("<lambda>", "<locals>")
    )


def _main_has_file() -> bool:
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return bool(path) and os.path.isfile(path)


@dataclass(frozen=True)
class ByValue:
    """A call pickled by value with cloudpickle: the function's code and the globals it
    uses travel to the workers, which need not import it. Plain pickle loads it (with
    cloudpickle importable there: the workers run the same Python environment)."""

    payload: bytes

    @classmethod
    def of(cls, fn: Callable[..., Any], args: tuple, kwargs: dict) -> ByValue:
        try:
            import cloudpickle
        except ImportError:
            raise MeshfitError(
                f"{getattr(fn, '__qualname__', fn)} cannot be imported by the worker "
                f"processes (a notebook cell, python -c, stdin, a lambda or a nested "
                f"function) and sending it by value needs cloudpickle: pip install "
                f"cloudpickle, or move it into a .py module"
            ) from None
        return cls(cloudpickle.dumps((fn, args, kwargs)))

    def __call__(self) -> Any:
        import pickle

        # Trusted bytes: the payload was pickled by the parent process that started this
        # worker (the user's own mf.launch call) and reached it through spawn's inherited
        # pipe, the same channel that carries every mf.launch function and argument; no
        # socket, store or file another party could write is involved.
        fn, args, kwargs = pickle.loads(self.payload)
        return fn(*args, **kwargs)


@contextlib.contextmanager
def _main_without_phantom_file() -> Iterator[None]:
    """Hide a __main__.__file__ that names no file (`python -` sets "<stdin>"): spawn
    would run it again in every worker, which fails at start-up."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path) or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


ERROR_DIR_ENV = "MESHFIT_LAUNCH_ERRORS"  # where mf.launch's workers report failures


def _importing_main_in_a_worker() -> bool:
    """Whether this process is a spawned worker still importing the parent's main script
    (as Python's spawn start method does, under the name __mp_main__): a launch there
    runs because the script calls it at import time, with no main guard."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _refuse_an_unguarded_call() -> None:
    """Refuse, before any worker starts, an mf.launch that the main script reaches from
    its top level outside `if __name__ == "__main__":`: every worker imports that script
    again (under spawn and the warm start alike) and would launch from there. Read from
    the script's own syntax tree: the line of its top-level code on the call stack."""
    import ast

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path) or getattr(main, "__spec__", None) is not None:
        return
    frame = sys._getframe(2)
    line = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and os.path.abspath(code.co_filename) == os.path.abspath(
            path
        ):
            line = frame.f_lineno
            break
        frame = frame.f_back
    if line is None:
        return
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, ast.If) and _tests_main_name(node.test):
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return
    raise MeshfitError(_unguarded_message(path))


def _tests_main_name(test: Any) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    import ast

    if not isinstance(test, ast.Compare) or len(test.comparators) != 1:
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and texts == ["__main__"]


def _unguarded_message(script: str) -> str:
    return (
        f"mf.launch ran while its workers imported {script}: workers start by importing "
        f"the script that launched them (Python's spawn), and this one calls mf.launch "
        f'at import time. Put the call under `if __name__ == "__main__":`'
    )


def _refuse_unguarded_main() -> None:
    """In a worker importing a script that calls mf.launch at its top level: report one
    line to the parent (which raises it) and leave, instead of torch's bootstrapping
    traceback from every worker."""
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "your script"
    error = MeshfitError(_unguarded_message(script))
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        _write_failure(error_dir, error)
    os._exit(1)


def _worker_main(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    error_dir: str,
    start: warm.WorkerStart | None = None,
) -> Any:
    if start is not None:  # forked from the warm server: start as a spawned worker would
        start.apply()
    threads = int(os.environ.get("MESHFIT_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    watchdog.set_on_hang(lambda line: _write_failure(error_dir, MeshfitError(line)))
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        watchdog.wait_if_stopping()
        timeout_line = watchdog.explain_collective_timeout(exc)
        if timeout_line is not None:
            exc = MeshfitError(timeout_line)
        _write_failure(error_dir, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit at once: atexit handlers could block on peers that are already gone.
        os._exit(1)
    shutdown_process_group()  # collected first (a gloo group's destructor can block after)
    return result


def _write_failure(error_dir: str, exc: BaseException) -> None:
    record = {
        "rank": int(os.environ.get("RANK", "-1")),
        "time": time.time(),
        "module": type(exc).__module__,
        "qualname": type(exc).__qualname__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    path = os.path.join(error_dir, f"rank-{record['rank']}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def died_how(exitcode: int) -> str:
    """How a worker ended without an exception meshfit could report, for one line."""
    if exitcode >= 0:
        return f"exited with code {exitcode} without raising an exception"
    number = -exitcode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    why = (
        ": the kernel's out-of-memory killer sends it when memory (or a cgroup's limit) "
        "runs out, so check the host's or container's memory first"
        if number == signal.SIGKILL
        else ""
    )
    return f"was killed by signal {number} ({name}){why}"


def _rebuild_worker_exception(error_dir: str, failed: Exception) -> BaseException:
    """The earliest worker exception (the cause; later ones are usually peers noticing
    it), rebuilt as its own type when that is possible."""
    records = []
    for name in os.listdir(error_dir):
        if name.endswith(".json"):
            with open(os.path.join(error_dir, name)) as f:
                records.append(json.load(f))
    if not records:
        rank, info = failed.get_first_failure()
        return WorkerError(f"worker rank {rank} {died_how(info.exitcode)}", rank)
    first = min(records, key=lambda r: r["time"])
    rank, message = first["rank"], first["message"]
    if first["module"] == MeshfitError.__module__ and first["qualname"] == "MeshfitError":
        return MeshfitError(message)
    exc: BaseException
    try:
        cls = getattr(importlib.import_module(first["module"]), first["qualname"])
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise TypeError(cls)
        exc = cls(message)
    except Exception:  # noqa: BLE001 - any exception type we cannot rebuild
        exc = WorkerError(f"{first['qualname']}: {message}", rank=rank)
    exc.add_note(f"raised on worker rank {rank}; worker traceback:\n{first['traceback']}")
    exc.rank = rank  # type: ignore[attr-defined]
    return exc


def hang_timeout_env(seconds: float | None) -> dict[str, str]:
    """The workers' environment for a hang timeout (watchdog.py reads it)."""
    if seconds is None:
        return {}
    if not seconds >= 0:
        raise MeshfitError(
            f"the hang timeout must be >= 0 seconds (0 turns hang detection off), not {seconds}"
        )
    return {watchdog.HANG_TIMEOUT_ENV: repr(float(seconds))}
