"""The `meshfit` command: devices, run, demo, verify, export, plot."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from typing import TYPE_CHECKING

from meshfit.errors import MeshfitError

if TYPE_CHECKING:
    from meshfit.verification.run import VerifyReport


def _devices(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from meshfit.launch.devices import format_inventory, inventory

    inv = inventory()
    table = Table(title="Devices meshfit can use here", title_justify="left")
    for column in ("device", "name", "memory", "detail"):
        table.add_column(column)
    for row in format_inventory(inv):
        table.add_row(*row)
    console = Console(highlight=False)
    console.print(table)
    if inv.cuda_visible_devices is not None:
        console.print(
            f"CUDA_VISIBLE_DEVICES={inv.cuda_visible_devices!r} (indices above are relative to it)"
        )
    backend = "nccl (GPU) + gloo (CPU)" if inv.gpus else "gloo"
    default = (
        f"{len(inv.gpus)} GPU workers"
        if inv.gpus
        else f"{2 if inv.cpu_cores >= 2 else 1} CPU workers"
    )
    console.print(
        f"torch {torch.__version__}; process groups: {backend}; meshfit run starts {default} by default"
    )
    return 0


# meshfit run's options that a --config file may hold, and their defaults; the run
# parser's own defaults are None so that an option given on the command line is known
RUN_DEFAULTS = {
    "nproc": None,
    "devices": None,
    "threads": None,
    "max_restarts": 0,
    "hang_timeout": None,
    "nnodes": None,  # 1 unless SLURM says otherwise (scheduler.fill_nodes)
    "node_rank": None,
    "master": None,
    "plan": None,
    "weights": None,
}


def _run(args: argparse.Namespace) -> int:
    from meshfit.launch.elastic import parse_nnodes
    from meshfit.launch.run_command import RunOptions, run
    from meshfit.launch.run_config import read_config, torchrun_passthrough
    from meshfit.launch.scheduler import fill_nodes

    config = read_config(args.config) if args.config else {}
    if args.script:  # the command line's script replaces the file's, with its args
        target, *rest = args.script
        module = args.module
    elif "script" in config or "module" in config:
        target = config.get("script") or config["module"]
        rest = list(config.get("args", []))
        module = "module" in config or args.module
    else:
        raise MeshfitError(
            "meshfit run needs a script: meshfit run [options] train.py [script args], or "
            "script = ... in a --config file"
        )
    if config.get("script") and not args.script and not os.path.isabs(target):
        # a script named in the file is found next to the file, wherever meshfit runs
        beside = os.path.join(os.path.dirname(os.path.abspath(args.config)), target)
        target = beside if os.path.isfile(beside) else target
    chosen = {
        key: getattr(args, key) if getattr(args, key) is not None else config.get(key, default)
        for key, default in RUN_DEFAULTS.items()
    }
    min_nodes = None
    if chosen["nnodes"] is not None:  # N, or MIN:MAX for an elastic run
        given_in = "--nnodes" if args.nnodes is not None else f"{args.config}: nnodes ="
        min_nodes, chosen["nnodes"] = parse_nnodes(chosen["nnodes"], given_in)
    filled = fill_nodes(chosen["nnodes"], chosen["master"], os.environ)
    if filled.line:
        print(filled.line, flush=True)  # on stdout: what the run got from SLURM
    chosen.update(nnodes=filled.nnodes, master=filled.master)
    chosen["min_nodes"] = min_nodes if min_nodes is not None and min_nodes < filled.nnodes else None
    passthrough = list(config.get("torchrun", []))
    for text in args.torchrun or []:
        passthrough += shlex.split(text)
    return run(
        RunOptions(
            target=target,
            target_args=tuple(rest),
            module=module,
            torchrun_args=torchrun_passthrough(passthrough),
            **chosen,
        )
    )


def _demo(args: argparse.Namespace) -> int:
    from meshfit.launch.run_command import RunOptions, run

    if args.verify:
        return _demo_verify(args)
    demo_args: list[str] = []
    for action in args.demo_actions:
        value = getattr(args, action.dest)
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                demo_args += [action.option_strings[0], str(item)]
    from meshfit.demo import parse_options

    parse_options(args.set)  # refuse a bad --set before starting workers
    if args.plan:
        from meshfit.plan import Plan

        Plan.check_text(args.plan)  # refuse a bad plan before starting workers
    return run(
        RunOptions(
            target="meshfit.demo",
            target_args=tuple(demo_args),
            module=True,
            nproc=args.nproc,
            devices=args.devices,
            max_restarts=args.max_restarts,
            threads=args.threads,
            hang_timeout=args.hang_timeout,
            plan=args.plan,
        )
    )


def _demo_verify(args: argparse.Namespace) -> int:
    """`meshfit demo --verify`: the demo's plans against one process, as one table."""
    from meshfit.demo import VERIFY_OPTIONS, verify_plans
    from meshfit.verification.run import reports_table

    ignored = [
        action.option_strings[0]
        for action in args.demo_actions
        if action.dest not in VERIFY_OPTIONS and getattr(args, action.dest) != action.default
    ]
    if args.max_restarts:
        ignored.append("--max-restarts")
    if ignored:
        raise MeshfitError(
            f"--verify trains its own small demo GPT for a few steps, so {', '.join(ignored)} "
            f"would change nothing; drop them (it takes --nproc, --plan, --steps, --seed, "
            f"--devices, --threads)"
        )
    title, reports = verify_plans(
        nproc=2 if args.nproc is None else args.nproc,
        steps=3 if args.steps is None else args.steps,
        plan=args.plan,
        seed=args.seed,
        devices=args.devices,
        threads=args.threads,
    )
    print(reports_table(reports, title), flush=True)
    return _verify_status(reports)


def _plan(args: argparse.Namespace) -> int:
    from meshfit.planner.command import run_plan_command

    return run_plan_command(args)


def _verify_status(reports: list[VerifyReport]) -> int:
    """0: every plan the same run; 1: some plan a different run; 2: refused."""
    if any(not r.ok and r.refused is None for r in reports):
        return 1
    return 2 if any(r.refused is not None for r in reports) else 0


VERIFY_HELP = """\
Train a model a few steps under PLAN on worker processes and in this one process, then
print both runs' per-step losses, the largest relative weight difference and a verdict.

TARGET is module:function (the current directory is on the import path), e.g.
mypkg.train:build_model_and_batch. The function takes no arguments and returns

    (model, batch, loss_fn)   or   (model, batch, loss_fn, options)

  model    a fresh torch.nn.Module, or a function that builds one
  batch    the global batch (inputs, targets), used at every step; or a list of
           batches (tuples), one per step
  loss_fn  loss_fn(outputs, targets) as mf.parallelize takes it ("model": the
           model's own loss)
  options  a dict of other mf.parallelize keywords: optimizer, grad_clip,
           tp_plan, pp_split, ... (the optimizer by default: SGD, lr 0.1,
           momentum 0.9, which keeps a wrongly scaled gradient visible)

meshfit calls it after torch.manual_seed(SEED), in this process for the one-process
run and in every worker for the plan's run, so both start from the same weights and
nothing of yours needs to pickle (a lambda loss_fn is fine); the workers train on the
batch it returned here. Both runs train in float64 (the model and the batch's
floating-point tensors converted), where a gradient off by one part in a million is a
different run: 1.9e-12 relative tolerance; a model that fails in float64 is compared in
its own dtype (1.0e-3 in float32), with a note saying why; --model-dtype keeps its own.
Copies of one parameter on several ranks (dp replicas, what tp leaves whole, pp's tied
weights) must also agree with each other.

exit status: 0 same run; 1 different run; 2 the plan was refused, bad input, or
an error in the model (its traceback is printed)
"""


def _verify(args: argparse.Namespace) -> int:
    from meshfit.verification.run import verify_target

    # As `python -m` does: the user's module is found from the current directory (and
    # the spawned workers inherit this path).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        report = verify_target(
            args.target,
            args.plan,
            steps=args.steps,
            nproc=args.nproc,
            rtol=args.rtol,
            seed=args.seed,
            devices=args.devices,
            threads=args.threads,
            in_float64=not args.model_dtype,
        )
    except MeshfitError:
        raise  # main prints it as one line, exit status 2
    except Exception as exc:  # noqa: BLE001 - the model's own error: shown, then status 2
        traceback.print_exc()
        print(
            f"meshfit: error: verify stopped by an error in the model or its data "
            f"({type(exc).__name__}: {exc}); its traceback is above",
            file=sys.stderr,
        )
        return 2
    print(report, flush=True)
    return _verify_status([report])


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="workers per node (default: the selected GPUs, else 2 CPU workers)",
    )
    parser.add_argument(
        "--devices", default=None, help="GPUs to use, e.g. 0,2 ('all' by default; 'cpu' for none)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per worker (default: 1 per CPU worker)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers up to K times after a failure (default 0; 3 for an "
        "elastic run, --nnodes MIN:MAX)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop the job when a rank makes no progress for S seconds while its peers "
        "wait, naming it and saving every rank's stack (default 120; 0 turns it off)",
    )


def build_parser() -> argparse.ArgumentParser:
    from meshfit import __version__
    from meshfit.demo import add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="meshfit",
        description="Train a PyTorch model on many devices: data, model and hybrid parallel.",
    )
    parser.add_argument("--version", action="version", version=f"meshfit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    devices = commands.add_parser("devices", help="list the CPU and GPUs that can be used here")
    devices.set_defaults(handler=_devices)

    run = commands.add_parser(
        "run",
        help="run a training script on several workers (torchrun underneath)",
        description="Run SCRIPT on workers; everything after SCRIPT is passed to it.",
    )
    _add_worker_options(run)
    run.add_argument(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help="number of nodes (default 1; under srun, the step's SLURM_STEP_NUM_NODES); "
        "MIN:MAX makes the run elastic: it goes on while MIN nodes remain and grows back "
        "up to MAX (with --max-restarts K, 3 by default; see 'Elastic runs' in docs/guide.md)",
    )
    run.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    run.add_argument(
        "--master",
        default=None,
        help="ADDR:PORT of node 0 (multi-node; under srun, the step's first host; without "
        "--node-rank every node needs the same MESHFIT_RUN_SECRET or MESHFIT_RUN_SECRET_FILE, "
        "see docs/security.md)",
    )
    run.add_argument(
        "--plan",
        default=None,
        help="the plan (e.g. tp=2,pp=2, or auto: the planner chooses) for the script's "
        "parallelize / fit calls that give none; a script that gives another one is refused",
    )
    run.add_argument(
        "--weights",
        default=None,
        help="pretrained safetensors (a file, or a directory save_pretrained wrote) for the "
        "script's parallelize / fit calls that give none; each rank reads only its slices "
        "of a model built on meta",
    )
    run.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m"
    )
    run.add_argument(
        "--config",
        default=None,
        metavar="RUN.TOML",
        help="the run's options in a TOML file (script, args, nproc, plan, devices, threads, "
        "max_restarts, hang_timeout, nnodes, node_rank, master, torchrun); options on the "
        "command line win over it",
    )
    run.add_argument(
        "--torchrun",
        action="append",
        default=None,
        metavar="'OPTIONS'",
        help="torchrun options passed as they are, in one quoted string split as a shell "
        "would, e.g. --torchrun '--log-dir logs --redirects 3' or --torchrun=--tee=3 (repeatable; those meshfit "
        "sets itself, such as --nproc-per-node, are refused naming meshfit's option)",
    )
    run.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]")
    run.set_defaults(handler=_run, **dict.fromkeys(RUN_DEFAULTS))

    demo = commands.add_parser(
        "demo",
        help="train a small GPT on Python's own source code (the main job)",
        description="Train a byte-level GPT on the standard library's source, then sample from it.",
    )
    _add_worker_options(demo)
    demo.add_argument(
        "--verify",
        action="store_true",
        help="instead of training: a few steps of a small demo GPT under dp, fsdp, tp and pp "
        "(or --plan), each beside one process, as a table of losses and weight differences",
    )
    demo.set_defaults(handler=_demo, demo_actions=add_demo_arguments(demo))

    verify = commands.add_parser(
        "verify",
        help="check that your model trains the same under a plan as in one process",
        description=VERIFY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("--plan", required=True, help="the plan to check, e.g. tp=2,pp=2")
    verify.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="worker processes (default: the plan's world size, with dp=1 when it leaves dp "
        "open; for dp alone the launcher's default)",
    )
    verify.add_argument(
        "--steps", type=int, default=None, help="training steps (default 3, or one per batch)"
    )
    verify.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="relative tolerance (default: from the model's dtype and the plan's precision)",
    )
    verify.add_argument("--seed", type=int, default=0, help="torch.manual_seed before each build")
    verify.add_argument(
        "--model-dtype",
        action="store_true",
        help="train both runs in the model's own dtype (default: float64 where it runs)",
    )
    verify.add_argument(
        "--devices", default=None, help="GPUs to use, e.g. 0,2 ('all' by default; 'cpu' for none)"
    )
    verify.add_argument(
        "--threads", type=int, default=None, help="intra-op threads per worker (default 1 on CPU)"
    )
    verify.add_argument("target", metavar="TARGET", help="module:function, see above")
    verify.set_defaults(handler=_verify)

    from meshfit.planner.command import PLAN_HELP, add_plan_arguments

    plan = commands.add_parser(
        "plan",
        help="rank every plan for a model by predicted speed, with memory per rank",
        description=PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_arguments(plan)
    plan.set_defaults(handler=_plan)

    export = commands.add_parser(
        "export",
        help="write a checkpoint's model weights as safetensors (no model code needed)",
        description="Write the model weights of CHECKPOINT (a step directory, or a checkpoint "
        "root for its newest intact step) to OUT: a .safetensors file, or a directory that "
        "gets model.safetensors, or Hugging Face-style shards of at most --max-shard-size "
        "with model.safetensors.index.json. It is read and written one file at a time, so "
        "the process holds at most one file's worth of the model. The files load with "
        "safetensors.torch.load_file and model.load_state_dict, with weights=, or (beside "
        "the model's config.json) with from_pretrained, whatever plan trained it.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("out", metavar="OUT")
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        help="the largest weights file in a directory OUT (bytes, or '500MB', '5GB'; default 5GB)",
    )
    export.set_defaults(handler=_export)

    plot = commands.add_parser(
        "plot",
        help="draw a run's curves (loss, eval loss, metrics, lr) as a PNG",
        description="Draw the records of RUN (a log_dir with metrics.csv, a checkpoint_dir "
        "with history.jsonl, or either file) as a PNG (needs matplotlib).",
    )
    plot.add_argument("run", metavar="RUN")
    plot.add_argument("--out", default=None, help="the PNG to write (default RUN/curves.png)")
    plot.set_defaults(handler=_plot)
    return parser


def _plot(args: argparse.Namespace) -> int:
    from meshfit.training.plot import plot_records, read_records

    out = args.out or os.path.join(
        args.run if os.path.isdir(args.run) else os.path.dirname(args.run) or ".", "curves.png"
    )
    print(f"meshfit: wrote {plot_records(read_records(args.run), out, title=args.run)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from meshfit.state.export import export_checkpoint

    export_checkpoint(args.checkpoint, args.out, args.max_shard_size)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except MeshfitError as exc:
        print(f"meshfit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
