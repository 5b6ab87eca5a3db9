"""`meshfit run --config run.toml`: the run's options in a file, and torchrun's own
options passed through.

    # run.toml
    script = "train.py"            # or module = "mypkg.train" (as -m)
    args = ["--lr", "3e-4"]        # the script's arguments
    nproc = 4
    plan = "tp=2,pp=2"
    devices = "0,1,2,3"
    threads = 1
    max_restarts = 1
    hang_timeout = 300
    nnodes = 2                     # or "2:4", an elastic run
    node_rank = 0
    master = "10.0.0.1:29500"
    torchrun = ["--log-dir", "logs", "--redirects", "3"]

Every key is optional. An option on the command line wins over the file's; a script on
the command line replaces the file's script and args. `torchrun` (in the file, or
`--torchrun "--log-dir logs"` on the command line, split as a shell would, added after
the file's) passes options to torchrun as they are, except those meshfit sets itself,
which are refused naming meshfit's own option.
"""

from __future__ import annotations

import os
import shlex
import tomllib
from typing import Any

from meshfit.errors import MeshfitError

# key: (type(s) it takes, what to write in the error)
KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "script": ((str,), "a path"),
    "module": ((str,), "a module name"),
    "args": ((list,), "a list of strings"),
    "nproc": ((int,), "a whole number"),
    "plan": ((str,), 'text such as "tp=2,pp=2"'),
    "weights": ((str,), "a path to safetensors"),
    "devices": ((str, int, list), 'text such as "0,2", or a list of GPU indices'),
    "threads": ((int,), "a whole number"),
    "max_restarts": ((int,), "a whole number"),
    "hang_timeout": ((int, float), "seconds"),
    "nnodes": ((int, str), 'a whole number, or "MIN:MAX" for an elastic run'),
    "node_rank": ((int,), "a whole number"),
    "master": ((str,), 'text such as "10.0.0.1:29500"'),
    "torchrun": ((list, str), "a list of strings"),
}

# torchrun options meshfit sets from its own: passing them through would fight them
OWNED = {
    "--nproc-per-node": "--nproc",
    "--nnodes": "--nnodes",
    "--node-rank": "--node-rank",
    "--master-addr": "--master ADDR:PORT",
    "--master-port": "--master ADDR:PORT",
    "--rdzv-backend": "--master (meshfit's signed rendezvous)",
    "--rdzv-endpoint": "--master ADDR:PORT",
    "--rdzv-id": "--master (the id comes from the run secret)",
    "--standalone": "the default (one node, loopback only)",
    "--local-addr": "the default (loopback on one node)",
    "--max-restarts": "--max-restarts",
    "--module": "-m / module = ...",
    "-m": "-m / module = ...",
    "--no-python": "a Python script or module",
    "--run-path": "script = ...",
    "--help": "meshfit run --help",
    "-h": "meshfit run --help",
}


def read_config(path: str) -> dict[str, Any]:
    """The options of a TOML run file, checked (unknown keys and wrong types refused)."""
    if not os.path.isfile(path):
        raise MeshfitError(f"no config file at {path!r}")
    try:
        with open(path, "rb") as f:
            config = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise MeshfitError(f"{path} is not valid TOML: {exc}") from None
    unknown = [k for k in config if k not in KEYS]
    if unknown:
        raise MeshfitError(
            f"{path}: unknown key(s) {', '.join(unknown)}; a run file takes "
            f"{', '.join(KEYS)} (torchrun's own options go in torchrun = [...])"
        )
    for key, value in config.items():
        types, wanted = KEYS[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise MeshfitError(f"{path}: {key} must be {wanted}, not {value!r}")
    if "script" in config and "module" in config:
        raise MeshfitError(f"{path}: give script or module, not both")
    for key in ("args", "torchrun"):
        if isinstance(config.get(key), list) and not all(isinstance(a, str) for a in config[key]):
            raise MeshfitError(f"{path}: {key} must be a list of strings, not {config[key]!r}")
    if isinstance(config.get("torchrun"), str):
        config["torchrun"] = shlex.split(config["torchrun"])
    if isinstance(config.get("devices"), (int, list)):
        devices = config["devices"]
        config["devices"] = ",".join(
            str(d) for d in (devices if isinstance(devices, list) else [devices])
        )
    return config


def torchrun_passthrough(args: list[str]) -> tuple[str, ...]:
    """torchrun options to pass as they are: each must be one torchrun knows and none
    one that meshfit sets."""
    from torch.distributed.run import get_args_parser

    known = {s for action in get_args_parser()._actions for s in action.option_strings}
    for arg in args:
        if not arg.startswith("-"):
            continue  # a value
        name = arg.split("=", 1)[0]
        canonical = name.replace("_", "-") if name.startswith("--") else name
        if canonical in OWNED:
            raise MeshfitError(
                f"torchrun option {name} is meshfit's to set: use {OWNED[canonical]} instead"
            )
        if name not in known:
            raise MeshfitError(
                f"torchrun has no option {name}; see python -m torch.distributed.run --help"
            )
    return tuple(args)
