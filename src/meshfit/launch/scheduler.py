"""`meshfit run` under SLURM: the nodes and node 0's address from the job's variables.

Started once per node by `srun --ntasks-per-node=1 meshfit run ... train.py`, every
node finds in its environment how many nodes the step has (SLURM_STEP_NUM_NODES, else
SLURM_NNODES / SLURM_JOB_NUM_NODES), which one it is (SLURM_NODEID) and the step's
hosts (SLURM_STEP_NODELIST, else SLURM_NODELIST / SLURM_JOB_NODELIST, in SLURM's
compressed form `node[01-03,07],gpu5`, expanded here: `scontrol show hostnames` is not
on every machine that runs meshfit). `--nnodes` and `--master` that are not given are
filled from them; what is given wins.

SLURM_NODEID is checked and shown but not passed as `--node-rank`: a fixed node rank
selects torch's static rendezvous, which has no authentication, whereas without one the
nodes meet in meshfit's signed rendezvous (docs/security.md), so the run still needs
its secret on every node.

Open MPI's and MPICH's variables (OMPI_COMM_WORLD_*, PMI_*) are not read: they number
tasks, not nodes, and name no host that could be node 0. A `meshfit run` that mpirun
started several times over without --nnodes/--master is refused with that note.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from meshfit.errors import MeshfitError
from meshfit.launch import stores

# Step variables first: srun sets them for the step it starts, which may hold fewer
# nodes than the job (srun -N1 inside a 4-node allocation); the job's come after.
NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
TASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
# Only srun sets these; a batch script or an salloc shell has the job's variables alone.
STEP_VARS = ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_ID")
MPI_SIZE_VARS = (("mpirun (Open MPI)", "OMPI_COMM_WORLD_SIZE"), ("mpirun (MPICH)", "PMI_SIZE"))

# Node 0's port: torchrun's 29500 outside a job. Inside one it moves with the job id, so
# two jobs that share a first node (nodes shared between jobs) do not both bind 29500;
# 20000-29999 stays below Linux's ephemeral ports (32768+), which the kernel hands out.
DEFAULT_PORT = 29500
JOB_PORT_BASE = 20000
JOB_PORT_SPAN = 10000

USE_SRUN = (
    "start one meshfit run per node: srun --ntasks-per-node=1 meshfit run --nproc "
    "WORKERS_PER_NODE train.py (see 'Several hosts' in docs/guide.md)"
)


# ---- SLURM's compressed host lists ---------------------------------------------------

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str) -> list[str]:
    """The host names of a SLURM host list, in order: `node[01-03,07],gpu5` ->
    node01, node02, node03, node07, gpu5. Zero padding follows the range's first number
    (SLURM's rule); several bracket groups in one name multiply out (`r[1-2]n[1-2]`)."""
    hosts: list[str] = []
    for item in _split_top_level(text):
        hosts += _expand_one(item, text)
    if not hosts:
        raise MeshfitError(f"the SLURM host list {text!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets (those inside separate ranges)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise MeshfitError(f"unbalanced brackets in the SLURM host list {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth != 0:
        raise MeshfitError(f"unbalanced brackets in the SLURM host list {text!r}")
    items.append(text[start:].strip())
    if any(not item for item in items):
        raise MeshfitError(f"an empty name in the SLURM host list {text!r}")
    return items


def _expand_one(item: str, whole: str) -> list[str]:
    """One name, with its first bracket group expanded and the rest recursively."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise MeshfitError(f"unbalanced brackets in the SLURM host list {whole!r}")
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    rests = _expand_one(tail, whole) if tail else [""]
    return [head + number + rest for number in _numbers(body, whole) for rest in rests]


def _numbers(body: str, whole: str) -> list[str]:
    """`01-03,07` -> 01, 02, 03, 07."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise MeshfitError(
                f"cannot read [{body}] in the SLURM host list {whole!r}: expected numbers "
                f"and ranges such as [01-03,07]"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise MeshfitError(f"the range {part} in the SLURM host list {whole!r} runs backwards")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


# ---- the job's variables -------------------------------------------------------------


@dataclass(frozen=True)
class SlurmNodes:
    """What a SLURM step says about its nodes, and which variable said each."""

    nnodes: int
    nnodes_var: str
    hosts: tuple[str, ...]
    hosts_var: str
    node_id: int
    port: int
    port_why: str


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _whole(name: str, value: str) -> int:
    if not value.isdigit():
        raise MeshfitError(f"{name}={value!r} is not a whole number; is this a SLURM job?")
    return int(value)


def in_slurm_job(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID") or _first(environ, NNODES_VARS))


def _is_srun_step(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name) for name in STEP_VARS)


def job_port(environ: Mapping[str, str]) -> tuple[int, str]:
    """Node 0's port for this job, and why that one."""
    job = environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return DEFAULT_PORT, "the default port"
    port = JOB_PORT_BASE + int(job) % JOB_PORT_SPAN
    return port, f"{JOB_PORT_BASE} + SLURM_JOB_ID % {JOB_PORT_SPAN}"


def read_slurm(environ: Mapping[str, str]) -> SlurmNodes:
    """The step's nodes, checked to be one meshfit run per node."""
    found = _first(environ, NNODES_VARS)
    if found is None:
        raise MeshfitError(f"no node count in this SLURM job ({' / '.join(NNODES_VARS)})")
    nnodes_var, nnodes = found[0], _whole(*found)
    listed = _first(environ, NODELIST_VARS)
    if listed is None:
        raise MeshfitError(f"no host list in this SLURM job ({' / '.join(NODELIST_VARS)})")
    hosts = expand_hostlist(listed[1])
    if len(hosts) != nnodes:
        raise MeshfitError(
            f"{listed[0]}={listed[1]!r} names {len(hosts)} hosts but {nnodes_var}={nnodes}; "
            f"give --nnodes and --master yourself"
        )
    if _is_srun_step(environ):
        _check_one_task_per_node(environ, nnodes)  # srun -n 2 on one node too
    elif nnodes > 1:
        raise MeshfitError(
            f"this SLURM job has {nnodes} nodes but meshfit run was not started by srun (a "
            f"batch script or salloc shell runs on the first node only): {USE_SRUN}"
        )
    node_id = _whole("SLURM_NODEID", environ.get("SLURM_NODEID", "0") or "0")
    if node_id >= nnodes:
        raise MeshfitError(f"SLURM_NODEID={node_id} is not below {nnodes_var}={nnodes}")
    port, why = job_port(environ)
    return SlurmNodes(nnodes, nnodes_var, tuple(hosts), listed[0], node_id, port, why)


def _check_one_task_per_node(environ: Mapping[str, str], nnodes: int) -> None:
    """meshfit run starts the workers of its node itself: it must run once per node."""
    found = _first(environ, TASKS_VARS)
    tasks = _whole(*found) if found else nnodes
    local_id = environ.get("SLURM_LOCALID", "0")
    if tasks > nnodes or (local_id.isdigit() and int(local_id) > 0):
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get(
            "SLURM_TASKS_PER_NODE", "?"
        )
        raise MeshfitError(
            f"srun started {tasks} tasks on {nnodes} node{'s' if nnodes != 1 else ''} "
            f"({per_node} per node), so "
            f"several meshfit runs would share a node; meshfit run starts a node's workers "
            f"itself (--nproc): use srun --ntasks-per-node=1 meshfit run --nproc "
            f"WORKERS_PER_NODE ..."
        )


def _refuse_mpi_copies(environ: Mapping[str, str]) -> None:
    """mpirun -np N meshfit run ...: N launchers that would each train alone."""
    for launcher, size_var in MPI_SIZE_VARS:
        size = environ.get(size_var, "1")
        if size.isdigit() and int(size) > 1:
            raise MeshfitError(
                f"{launcher} started meshfit run {size} times ({size_var}={size}), and its "
                f"variables name no hosts, so meshfit cannot tell the nodes and node 0 from "
                f"them: start one meshfit run per node with --nnodes NODES --master "
                f"NODE0_ADDR:PORT (one task per node: mpirun --npernode 1, or -ppn 1), or srun on SLURM"
            )


# ---- filling meshfit run's options -------------------------------------------------------


@dataclass(frozen=True)
class Filled:
    nnodes: int
    master: str | None
    line: str | None  # what came from SLURM, for stdout; None when nothing did


def fill_nodes(nnodes: int | None, master: str | None, environ: Mapping[str, str]) -> Filled:
    """`--nnodes` and `--master` as given, the missing ones from SLURM's variables.

    Outside a SLURM job (and with both given) nothing is read: a run is one node unless
    the options say otherwise. A SLURM job of one node stays a single-node run, on
    loopback, with no secret needed."""
    if nnodes is not None and (master is not None or nnodes == 1):
        return Filled(nnodes, master, None)
    if not _is_srun_step(environ):
        _refuse_mpi_copies(environ)  # srun --mpi=pmi2 sets PMI_SIZE too: a step wins
    if not in_slurm_job(environ):
        return Filled(1 if nnodes is None else nnodes, master, None)
    slurm = read_slurm(environ)
    taken: list[str] = []
    if nnodes is None:
        nnodes = slurm.nnodes
        taken.append(f"--nnodes {nnodes} ({slurm.nnodes_var})")
    if master is None and nnodes > 1:
        _refuse_loopback_host(slurm.hosts[0])
        master = f"{_bracketed(slurm.hosts[0])}:{slurm.port}"
        taken.append(f"--master {master} (first host of {slurm.hosts_var}, {slurm.port_why})")
    line = (
        f"meshfit: from SLURM: {', '.join(taken)}; this is node {slurm.node_id} of "
        f"{slurm.nnodes} (SLURM_NODEID)"
    )
    return Filled(nnodes, master, line)


def addresses_of(host: str) -> list[str]:
    """The addresses `host` resolves to here; none when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def _refuse_loopback_host(host: str) -> None:
    """A first host whose name resolves to loopback here (Debian's /etc/hosts maps a
    machine's own name to 127.0.1.1) would host the rendezvous where no other node can
    reach it, and the others would time out: say so before starting."""
    found = addresses_of(host)
    if found and all(stores.is_loopback(addr) for addr in found):
        raise MeshfitError(
            f"the first host of the SLURM job, {host}, resolves to {found[0]} (loopback) on "
            f"this node, where the other nodes cannot reach it: give --master ADDR:PORT "
            f"with its address on the cluster network"
        )


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, so that ADDR:PORT splits at the last colon."""
    return f"[{host}]" if ":" in host else host
