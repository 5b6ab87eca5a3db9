"""Joining the process group the launcher (torchrun / mf.launch) started: its store for
this attempt, gloo for CPU tensors and NCCL for GPU ones, and the checks around it."""

from __future__ import annotations

import atexit
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from meshfit.errors import MeshfitError
from meshfit.launch import watchdog
from meshfit.launch.devices import worker_device


def env_world_size() -> int:
    """World size as the launcher (torchrun / mf.launch) set it; 1 for a plain process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(timeout_s: float | None = None, *, alone: bool = False) -> torch.device:
    """Start the default process group if a launcher asked for one; return this
    worker's device.

    NCCL drives GPU tensors and gloo CPU tensors (one group serving both, so CPU-side
    collectives such as checkpoint coordination also work on GPU runs). A plain single
    process starts no group, unless `alone`: then a group of one (FSDP2, which offload
    is built on, runs only in a process group), kept in memory, no ports opened.
    """
    device = worker_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if is_distributed():
        return device
    if env_world_size() == 1:
        _refuse_a_copy_among_many()
        if alone:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        return device
    atexit.register(_destroy_at_exit)
    # Hang detection talks to the launcher's store on its own connection, so it works
    # while a collective is stuck; started before the group, which waits for every rank.
    watchdog.start(int(os.environ.get("RANK", "0")), env_world_size())
    if timeout_s is None:
        timeout_s = float(os.environ.get("MESHFIT_TIMEOUT_S", "1800"))
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    return device


def _refuse_a_copy_among_many() -> None:
    """A plain process that a cluster launcher started several times over (`srun -n 4
    python train.py`, `mpirun -n 4 ...`) would train alone, once per task, all writing
    the same checkpoints: refuse, naming the launch that joins the tasks."""
    for launcher, count_var, rank_var in (
        ("srun (SLURM)", "SLURM_NTASKS", "SLURM_PROCID"),
        ("mpirun (Open MPI)", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        ("mpirun (MPICH / Intel MPI)", "PMI_SIZE", "PMI_RANK"),
    ):
        tasks = os.environ.get(count_var, "1")
        if tasks.isdigit() and int(tasks) > 1 and rank_var in os.environ:
            raise MeshfitError(
                f"this process is task {os.environ[rank_var]} of {tasks} that {launcher} "
                f"started, with no process group among them: each would train alone and "
                f"write the same checkpoints. Start one task per node that runs the workers: "
                f"e.g. srun --ntasks-per-node=1 meshfit run --nproc GPUS_PER_NODE train.py "
                f"(nodes and master from SLURM; elsewhere add --nnodes NODES --master "
                f"HOST:PORT; see 'Launching' in docs/guide.md)"
            )


def _destroy_at_exit() -> None:
    """Tear the process group down before the interpreter does, as PyTorch asks. It is
    local: no collective, no waiting. It does not stop gloo's threads while anything
    still holds the group (a DeviceMesh, the engine), so it cannot prevent the abort at
    interpreter teardown that `meshfit run` workers avoid by exiting past it
    (meshfit/launch/boot.py)."""
    with contextlib.suppress(Exception):
        shutdown_process_group()


def shutdown_process_group() -> None:
    """The watchdog stopped and the process group destroyed, at a worker's end. Objects
    in reference cycles that hold groups (an engine's DDP Reducer, a DeviceMesh) are
    collected first, while every group is live, and the collector is off afterwards: a
    collection after destroy_process_group freed a Reducer whose ProcessGroupGloo's
    destructor then blocked on its mutex (measured: a worker of
    tests/test_precision_fp8.py hung so while torch pickled its result). What the
    interpreter's own teardown frees is not covered (boot.py exits past it)."""
    import gc

    watchdog.stop()
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.disable()


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """The launcher's store, under a prefix unique to this restart attempt.

    Under torchrun/elastic the agent keeps one TCPStore (same MASTER_PORT) across
    restarts, so after a worker dies the keys where the previous attempt's ranks
    published their gloo addresses are still there: a restarted rank can read a dead
    peer's address and fail with "connection refused" (measured: 3 of 3 restarts failed
    on torch 2.13 with 2 CPU workers). A per-attempt prefix keeps each attempt's keys
    apart. Outside an elastic launch this returns None and env:// is used as usual.

    The prefix is the rendezvous round (MESHFIT_RDZV_ROUND, from meshfit's handler) when
    there is one: when a host dies and is started again, its new agent counts restarts
    from 0 while the others count 1, and keyed by restart count the new host's ranks
    read the dead attempt's addresses ("Connection refused" in connectFullMesh, measured
    between two network namespaces). All nodes of a round share its number.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    attempt = watchdog.attempt_id()
    world_size = int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=not agent_hosts_store and int(os.environ["RANK"]) == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    return dist.PrefixStore(f"meshfit/attempt-{attempt}/", store)
