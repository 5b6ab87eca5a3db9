"""The `meshfit` command: devices, run, demo."""

from __future__ import annotations

import argparse
import sys

from meshfit.errors import MeshfitError


def _devices(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from meshfit.devices import format_inventory, inventory

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


def _run(args: argparse.Namespace) -> int:
    from meshfit.launch import RunOptions, run

    if not args.script:
        raise MeshfitError(
            "meshfit run needs a script: meshfit run [options] train.py [script args]"
        )
    target, *rest = args.script
    return run(
        RunOptions(
            target=target,
            target_args=tuple(rest),
            module=args.module,
            nproc=args.nproc,
            devices=args.devices,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master=args.master,
            max_restarts=args.max_restarts,
            threads=args.threads,
            hang_timeout=args.hang_timeout,
        )
    )


def _demo(args: argparse.Namespace) -> int:
    from meshfit.launch import RunOptions, run

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

        Plan.parse(args.plan).validate()  # refuse a bad plan before starting workers
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
        )
    )


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
        help="restart the workers up to K times after a failure (default 0)",
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
    run.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    run.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    run.add_argument(
        "--master",
        default=None,
        help="ADDR:PORT of node 0 (multi-node; without --node-rank every node needs the same "
        "MESHFIT_RUN_SECRET or MESHFIT_RUN_SECRET_FILE, see docs/security.md)",
    )
    run.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m"
    )
    run.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]")
    run.set_defaults(handler=_run)

    demo = commands.add_parser(
        "demo",
        help="train a small GPT on Python's own source code (the main job)",
        description="Train a byte-level GPT on the standard library's source, then sample from it.",
    )
    _add_worker_options(demo)
    demo.set_defaults(handler=_demo, demo_actions=add_demo_arguments(demo))
    return parser


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
