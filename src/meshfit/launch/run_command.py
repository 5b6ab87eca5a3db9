"""`meshfit run script.py`: a script on workers the way torchrun would start it (it is
torchrun underneath, torch.distributed.run), with meshfit's defaults: one worker per
device or core, threads per worker, signed rendezvous, loopback-only on one node, the
plan and the weights of the command line handed to the workers' parallelize and fit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Any

from meshfit.errors import MeshfitError
from meshfit.launch import (
    LOOPBACK,
    WorkerSetup,
    _patched_environ,
    _quiet_elastic_logs,
    died_how,
    hang_timeout_env,
    interface_env,
    loopback_env,
    plan_workers,
    rendezvous,
    warm,
    watchdog,
)
from meshfit.launch.elastic import ELASTIC_ENV, ELASTIC_RDZV_CONF
from meshfit.launch.markers import (
    MARKER_DIR_ENV,
    killed_by_verdict,
    newest_checkpoint,
    raised_by,
)
from meshfit.launch.worker_errors import EXIT_USER_ERROR


@dataclass(frozen=True)
class RunOptions:
    target: str  # script path, or module name when module=True
    target_args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | None = None
    devices: str | None = None
    nnodes: int = 1  # the most nodes (MAX of --nnodes MIN:MAX)
    min_nodes: int | None = None  # MIN of --nnodes MIN:MAX: an elastic run; None: nnodes
    node_rank: int | None = None
    master: str | None = None
    max_restarts: int = 0
    threads: int | None = None
    hang_timeout: float | None = None  # seconds; None: the default, 0: off
    plan: str | None = None  # the plan for parallelize/fit calls that give none
    weights: str | None = None  # pretrained safetensors for parallelize/fit calls that give none
    torchrun_args: tuple[str, ...] = ()  # torchrun's own options, passed as they are


PLAN_ENV = "MESHFIT_PLAN"  # meshfit run --plan: read by parallelize / fit (engine.as_plan)
WEIGHTS_ENV = "MESHFIT_WEIGHTS"  # meshfit run --weights: read by parallelize


def torchrun_argv(options: RunOptions, setup: WorkerSetup, rdzv_id: str) -> list[str]:
    """The torch.distributed.run arguments for these options; `rdzv_id` names the
    rendezvous (rendezvous.run_id of the run's secret)."""
    argv = [
        "--nproc-per-node",
        str(setup.nproc),
        "--max-restarts",
        str(options.max_restarts),
        "--monitor-interval",
        "0.5",
    ]
    if is_single_node(options):
        # As torchrun --standalone, but on meshfit's backend: a free port, loopback only.
        argv += [
            "--rdzv-backend",
            rendezvous.BACKEND,
            "--rdzv-endpoint",
            f"{LOOPBACK}:0",
            "--rdzv-id",
            rdzv_id,
            "--local-addr",
            LOOPBACK,
        ]
    else:
        if options.master is None:
            raise MeshfitError(
                f"--nnodes {options.nnodes} needs --master ADDR:PORT, the address of node 0 "
                f"that every node can reach"
            )
        addr, _, port = options.master.rpartition(":")
        if not addr or not port.isdigit():
            raise MeshfitError(
                f"--master must be ADDR:PORT (e.g. 10.0.0.1:29500), not {options.master!r}"
            )
        argv += ["--nnodes", nnodes_arg(options)]
        if options.node_rank is not None:
            if not 0 <= options.node_rank < options.nnodes:
                raise MeshfitError(
                    f"--node-rank must be between 0 and {options.nnodes - 1}, not {options.node_rank}"
                )
            # Fixed node ranks: static rendezvous at node 0's address.
            argv += [
                "--node-rank",
                str(options.node_rank),
                "--master-addr",
                addr,
                "--master-port",
                port,
            ]
        else:
            # Elastic rendezvous: node ranks are assigned as nodes join; the state is
            # signed with the run's secret (rendezvous.py).
            argv += [
                "--rdzv-backend",
                rendezvous.BACKEND,
                "--rdzv-endpoint",
                options.master,
                "--rdzv-id",
                rdzv_id,
            ]
    passed = list(options.torchrun_args)
    if is_elastic(options):
        passed, conf = elastic_rdzv_conf(passed)
        argv += ["--rdzv-conf", conf]
    argv += passed  # checked in run_config: none of the above
    # Each worker runs meshfit/launch/boot.py, which runs the target and then exits past the
    # interpreter's teardown (a gloo thread can abort a finished worker there; boot.py).
    argv.append(BOOT)
    if options.module:
        argv.append("--meshfit-module")
    argv.append(options.target)
    argv += list(options.target_args)
    return argv


BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")


def _run_workers(args: Any) -> None:
    """torchrun's run of the parsed `args`. With MESHFIT_WARM_START=1 its workers are
    forked warm (launch/warm.py: torch and meshfit imported once, in the server, and a
    restart after a failure forks again rather than starting interpreters) where meshfit
    starts them itself: a Python script or module through boot.py; torchrun's own
    options (--log-dir, --redirects, --tee, ...) apply as to its subprocess workers.

    Off by default for `meshfit run`, unlike `mf.launch`: a forked worker is the
    server's child, not the agent's, and /proc/PID/environ and the command line show
    the server's (tools that find workers by them, as benchmarks/faults.py does, see
    none); in a memory-capped container the copy-on-write of the server's pages counts
    against the worker that touches them; and a script run once gains little (the
    server imports torch as each fresh worker would, in parallel on as many cores).
    Measured: BENCHMARKS.md, "Warm starts"."""
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    plain = not args.no_python and not args.run_path and not args.standalone
    wanted = warm.enabled(default=False)  # opt-in: see the docstring
    base = warm.ensure_server() if wanted and plain and args.training_script == BOOT else None
    if base is None:
        torchrun.run(args)
        return
    config, _, cmd_args = torchrun.config_from_args(args)
    config.start_method = "forkserver"
    # cmd_args: -u, boot.py, then what boot.py takes ([--meshfit-module] target args)
    boot_args = cmd_args[cmd_args.index(BOOT) + 1 :]
    elastic_launch(config, run_script_warm)(warm.WorkerStart(base), *boot_args)


def run_script_warm(start: warm.WorkerStart, *argv: str) -> None:
    """A warm `meshfit run` worker: what `python -u boot.py ARGV` does in a fresh one.
    The script runs as __main__; its exit handlers run when it ends, as the
    interpreter's would; then the worker leaves without the interpreter's teardown (the
    multiprocessing child exits with os._exit, which is what boot.py arranges in a
    subprocess: a gloo thread could abort a finished worker in that teardown). A failure
    leaves with its status (the agent restarts or stops as torchrun would)."""
    import atexit

    from meshfit.launch import boot as _boot

    start.apply()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # python -u
    status = _boot.run_target(list(argv))
    atexit._run_exitfuncs()
    if status:
        _boot._status[0] = status
        _boot._exit_now()


def nnodes_arg(options: RunOptions) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic run."""
    if is_elastic(options):
        return f"{options.min_nodes}:{options.nnodes}"
    return str(options.nnodes)


def is_elastic(options: RunOptions) -> bool:
    return options.min_nodes is not None and options.min_nodes < options.nnodes


def split_rdzv_conf(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """torchrun's arguments without their --rdzv-conf (`--rdzv-conf K=V,...` or
    `--rdzv-conf=K=V,...`, repeatable), and the settings those gave."""
    rest, given = [], []
    items = iter(args)
    for arg in items:
        name, eq, value = arg.partition("=")
        if name in ("--rdzv-conf", "--rdzv_conf"):
            given.append(value if eq else next(items, ""))
        else:
            rest.append(arg)
    conf = {}
    for pair in ",".join(given).split(","):
        key, _, value = pair.partition("=")
        if key.strip():
            conf[key.strip()] = value.strip()
    return rest, conf


def elastic_rdzv_conf(args: list[str]) -> tuple[list[str], str]:
    """torchrun's arguments without their --rdzv-conf, and that conf with meshfit's
    elastic defaults (ELASTIC_RDZV_CONF) for the keys it does not set."""
    rest, given = split_rdzv_conf(args)
    conf = {**ELASTIC_RDZV_CONF, **given}
    return rest, ",".join(f"{k}={v}" for k, v in conf.items())


# The restarts an elastic run takes when --max-restarts is not given: it re-forms its
# group by restarting the workers, so a budget of none could never re-form.
ELASTIC_RESTARTS = 3


def check_elastic(options: RunOptions) -> RunOptions:
    """Refuse an elastic run that could not re-form its group; one without a restart
    budget takes ELASTIC_RESTARTS (said at start-up)."""
    if not is_elastic(options):
        return options
    if options.node_rank is not None:
        raise MeshfitError(
            f"--nnodes {nnodes_arg(options)} (elastic) assigns node ranks as nodes join; "
            f"drop --node-rank"
        )
    if options.master is None:
        raise MeshfitError(
            f"--nnodes {nnodes_arg(options)} needs --master ADDR:PORT, the address of the "
            f"node that hosts the rendezvous (it must stay up: the others re-form around it)"
        )
    if options.max_restarts < 1:
        return replace(options, max_restarts=ELASTIC_RESTARTS)
    return options


def check_elastic_plan(options: RunOptions, nproc: int) -> None:
    """A fixed --plan must fit every world an elastic run can re-form into (MIN to MAX
    nodes of `nproc` workers): refused here, once, rather than by every restart."""
    from meshfit.plan import Plan, is_auto

    if not is_elastic(options) or options.plan is None or is_auto(options.plan):
        return
    from meshfit.topology import fit_plan

    plan = Plan.parse(options.plan)
    for nodes in range(options.min_nodes or options.nnodes, options.nnodes + 1):
        try:
            fit_plan(plan, nodes * nproc).validate()
        except MeshfitError as refused:
            raise MeshfitError(
                f"--plan {options.plan} does not fit {nodes} node{'s' if nodes != 1 else ''} "
                f"of {nproc} workers, a world this elastic run (--nnodes "
                f"{nnodes_arg(options)}) may re-form into: {refused}"
            ) from None


def check_plan_fits_world(options: RunOptions, nproc: int) -> None:
    """A fixed --plan that cannot fill the world this run starts (--nproc x --nnodes) is
    refused before any worker starts (each worker refused it after starting)."""
    from meshfit.plan import Plan, is_auto

    if options.plan is None or is_auto(options.plan) or is_elastic(options):
        return  # an elastic run's worlds: check_elastic_plan
    world = nproc * options.nnodes
    try:
        Plan.parse(options.plan).resolve(world).validate()
    except MeshfitError as refused:
        raise MeshfitError(
            f"--plan {options.plan} does not fit the {world} worker(s) this run starts "
            f"(--nproc {nproc} x --nnodes {options.nnodes}): {refused}"
        ) from None


def stopped_by_signal(signum: int, marker_dir: str) -> str:
    """The one line of a run stopped by a signal (a scheduler's preemption sends SIGTERM;
    torch's agent raised its SignalException traceback): the workers were stopped, and
    the newest intact checkpoint to resume from. meshfit does not save on a signal: the
    grace a scheduler gives may be shorter than a save, and a half save is never kept."""
    import signal

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    newest = newest_checkpoint(marker_dir)
    resume = (
        f"the newest intact checkpoint is {newest[1]} (step {newest[0]}): run the same "
        f"command to resume from it"
        if newest
        else "no checkpoint was written in this run (fit(checkpoint_dir=...) writes them)"
    )
    return f"stopped by {name}: every worker was stopped; {resume}"


def too_few_nodes(options: RunOptions, argv: list[str]) -> str:
    """Why the rendezvous timed out, and what to do: fewer than MIN nodes were there
    within join_timeout (at the start, or after a node was lost)."""
    wait = split_rdzv_conf(argv)[1].get("join_timeout", "600")
    least = options.min_nodes if is_elastic(options) else options.nnodes
    return (
        f"stopped: fewer than {least} node{'s' if least != 1 else ''} joined the rendezvous "
        f"at {options.master} within {wait} s (join_timeout), at the start or after a node "
        f"was lost; the newest checkpoint is kept: start the nodes again (at least {least}) "
        f"and the run resumes from it"
    )


def is_single_node(options: RunOptions) -> bool:
    return options.nnodes == 1 and options.master is None


def _uses_signed_rendezvous(options: RunOptions) -> bool:
    """Every run but the static rendezvous of fixed node ranks (--node-rank)."""
    return is_single_node(options) or options.node_rank is None


def run(options: RunOptions) -> int:
    """Run a script on workers the way torchrun would, with meshfit's defaults.
    Returns the exit status (0 when every worker succeeded)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if not options.module and not os.path.isfile(options.target):
        raise MeshfitError(f"no script at {options.target!r}; give the path of a Python file")
    if options.nnodes < 1:
        raise MeshfitError(f"--nnodes must be at least 1, not {options.nnodes}")
    if options.max_restarts < 0:
        raise MeshfitError(f"--max-restarts must be >= 0, not {options.max_restarts}")
    budget_given = options.max_restarts > 0
    options = check_elastic(options)
    setup = plan_workers(options.nproc, options.devices, options.threads)
    check_elastic_plan(options, setup.nproc)
    if is_elastic(options):
        setup.env[ELASTIC_ENV] = nnodes_arg(options)
    setup.env.update(hang_timeout_env(options.hang_timeout))
    if options.plan is not None:
        from meshfit.plan import Plan

        Plan.check_text(options.plan)  # refuse bad text here, not in every worker
        check_plan_fits_world(options, setup.nproc)
        setup.env[PLAN_ENV] = options.plan
    if options.weights is not None:
        if not os.path.exists(options.weights):
            raise MeshfitError(f"--weights {options.weights!r}: no such file or directory")
        setup.env[WEIGHTS_ENV] = os.path.abspath(options.weights)
    # One node: a secret made here, kept in memory. Several: the one every node was given.
    secret = rendezvous.new_secret() if is_single_node(options) else None
    if secret is None and _uses_signed_rendezvous(options):
        secret = rendezvous.read_secret()  # refuse a missing secret before starting
    rendezvous.register()
    argv = torchrun_argv(options, setup, rendezvous.run_id(secret) if secret else "none")
    where = (
        f"{setup.nproc} GPU workers"
        if setup.device_kind == "cuda"
        else f"{setup.nproc} CPU workers ({setup.threads} thread{'s' if setup.threads != 1 else ''} each)"
    )
    nodes = f" on each of {options.nnodes} nodes" if options.nnodes > 1 else ""
    if is_elastic(options):
        nodes = f" on each of {options.min_nodes} to {options.nnodes} nodes"
    print(f"meshfit: starting {where}{nodes}: {options.target}", file=sys.stderr, flush=True)
    if is_elastic(options):
        print(
            f"meshfit: elastic run: when a node is lost (while {options.min_nodes} remain; "
            f"{options.max_restarts} failures at most"
            f"{'' if budget_given else ', the default: --max-restarts K to change'}) or one "
            f"joins, the group re-forms and fit resumes from the newest checkpoint with the "
            f"plan fitted to the new world",
            file=sys.stderr,
            flush=True,
        )
    ifname_env: dict[str, str] = {}
    if not is_single_node(options) and options.master is not None:
        ifname_env, line = interface_env(options.master)
        if line:
            print(line, file=sys.stderr, flush=True)
    level = logging.WARNING if options.max_restarts else logging.CRITICAL
    markers = tempfile.mkdtemp(prefix="meshfit-markers-")  # workers' one-line-error claims
    try:
        env = {**setup.env, **ifname_env, MARKER_DIR_ENV: markers}
        if is_single_node(options):
            env.update(loopback_env())
        with (
            _patched_environ(env),
            rendezvous.using_secret(secret) if secret else contextlib.nullcontext(),
            _quiet_elastic_logs(level),
        ):
            _run_workers(torchrun.parse_args(argv))
    except RendezvousTimeoutError:
        print(f"meshfit: {too_few_nodes(options, argv)}", file=sys.stderr, flush=True)
        return 1
    except SignalException as stopped:
        print(f"meshfit: {stopped_by_signal(stopped.sigval, markers)}", file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        rank, info = failed.get_first_failure()
        code = info.exitcode if info.exitcode and info.exitcode > 0 else 1
        reported = {f.exitcode for f in failed.failures.values()} & {
            EXIT_USER_ERROR,
            watchdog.EXIT_HANG,
        }
        if any(killed_by_verdict(markers, f.pid) for f in failed.failures.values()):
            reported.add(watchdog.EXIT_HANG)
        if reported:
            return min(reported)  # a worker already printed the one-line reason
        raised = raised_by(markers, info.pid)
        how = (
            f"raised {raised}; its traceback"
            if raised
            else f"{died_how(info.exitcode)}; its message, if any,"
        )
        print(
            f"meshfit: worker rank {rank} {how} is above",
            file=sys.stderr,
            flush=True,
        )
        return code
    finally:
        os.environ.pop(rendezvous.ROUND_ENV, None)  # set by the handler for the workers
        shutil.rmtree(markers, ignore_errors=True)
    return 0
