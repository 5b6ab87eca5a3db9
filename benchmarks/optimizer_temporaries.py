"""What an optimizer's step makes beside its parameters, gradients and state, by how it
steps: one parameter at a time (torch's default on the CPU), a list at a time
(`foreach=True`, torch's default on a GPU) or fused (`fused=True`, meshfit's AdamW on a
GPU), against what the planner counts (planner/memory.py's `step_temporaries`, from its
STEP_TEMPORARIES and FOREACH_TEMPORARIES).

Two float32 parameters, 1024 x 256 and 256 x 256 (4096 x 1024 and 1024 x 1024 with
--large), their gradients set, the state made by a first step; `memory_probe` counts the
live tensor bytes of the second step, and what is neither parameter, gradient nor state
at its peak is the step's temporaries. The same code paths run on the CPU as on a GPU
(forced by the flags), so the counts carry over; a GPU's allocator rounds them up.

    python benchmarks/optimizer_temporaries.py [--large] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from meshfit.planner.memory import step_temporaries
from meshfit.planner.memory_probe import measure_peak

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
}
STEPPINGS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def made(name: str, stepping: str, shapes: list[tuple[int, int]]) -> int | None:
    """Bytes of temporaries at the peak of one step; None where torch has no such
    implementation (fused RMSprop)."""
    kind, options = OPTIMIZERS[name]
    params = nn.ParameterList([nn.Parameter(torch.randn(*shape)) for shape in shapes])
    try:
        optimizer = kind(params.parameters(), lr=0.01, **options, **STEPPINGS[stepping])
    except (TypeError, RuntimeError, ValueError):
        return None
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # its state made
    return measure_peak(optimizer.step, modules=[params], optimizers=[optimizer]).other


def counted(name: str, stepping: str, shapes: list[tuple[int, int]]) -> int:
    """The planner's count for the same parameters (float32)."""
    sizes = [a * b for a, b in shapes]
    of_largest, of_all = step_temporaries(name, stepping)
    return int((of_largest * max(sizes) + of_all * sum(sizes)) * 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="4096 x 1024 and 1024 x 1024")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    shapes = [(4096, 1024), (1024, 1024)] if args.large else [(1024, 256), (256, 256)]
    largest, everything = max(a * b for a, b in shapes) * 4, sum(a * b for a, b in shapes) * 4
    torch.manual_seed(0)
    rows = []
    print("optimizer     stepping  made (x largest, x all)  counted (x largest, x all)")
    for name in OPTIMIZERS:
        for stepping in STEPPINGS:
            got = made(name, stepping, shapes)
            if got is None:
                continue
            count = counted(name, stepping, shapes)
            rows.append({"optimizer": name, "stepping": stepping, "made": got, "counted": count})
            print(
                f"{name:13s} {stepping:9s} {got / largest:5.2f} {got / everything:5.2f}"
                f"{'':14s} {count / largest:5.2f} {count / everything:5.2f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shapes": shapes, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
