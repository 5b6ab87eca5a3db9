"""Trained by tests/test_elastic.py under `meshfit run --nnodes MIN:MAX` on the
namespace test bed (float64, AdamW, checkpoints every 2 steps, plan from --plan).

--stall-at S --stall-marker PATH: on a host started with ELASTIC_STALL=1, every worker
    stops after step S of its first attempt (each adds a line to PATH), so the test can kill the
    host or cut its link while the others wait in the next step's collective.
--hold-at T --hold-marker PATH --full-world N: once the group has shrunk below N
    processes, it holds after step T (writing PATH) until the agents restart it for a
    node that joined; so a test can grow it back before the run ends, whatever the speed.
With ELASTIC_TIMES=1, rank 0 prints "elastic-times: start" when its process starts and
"elastic-times: step N" after each step (benchmarks/elastic_recovery.py times them).
Rank 0 of the run that finishes writes --out: losses, final weights, the world size and
History.world_changes."""

import argparse
import os
import time

TIMES = os.environ.get("ELASTIC_TIMES") == "1" and os.environ.get("RANK") == "0"
if TIMES:
    print("elastic-times: start", flush=True)

import torch  # noqa: E402
from workers import build, dataset, optimizer_factory  # noqa: E402

import meshfit as mf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--model", default="mlp")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--batch", type=int, default=24)
parser.add_argument("--stall-at", type=int, default=None)
parser.add_argument("--stall-marker", default=None)
parser.add_argument("--hold-at", type=int, default=None)
parser.add_argument("--hold-marker", default=None)
parser.add_argument("--full-world", type=int, default=None)
args = parser.parse_args()


def pause(step: int, engine: mf.Engine) -> None:
    if TIMES:
        print(f"elastic-times: step {step}", flush=True)
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if step == args.stall_at and first and os.environ.get("ELASTIC_STALL") == "1":
        with open(args.stall_marker, "a") as f:
            f.write(f"{engine.rank}\n")
        time.sleep(600)
    shrunk = args.full_world and engine.world_size < args.full_world
    if step == args.hold_at and shrunk:
        with open(args.hold_marker, "a") as f:
            f.write(f"{engine.rank}\n")
        time.sleep(300)  # until the agent restarts the group for the joining node


model, loss_fn = build(args.model)
history = mf.fit(
    model,
    dataset(args.model, 96),
    loss_fn=loss_fn,
    optimizer=optimizer_factory("adamw"),
    batch_size=args.batch,
    max_steps=args.steps,
    checkpoint_dir=args.checkpoint_dir,
    checkpoint_every=2,
    log_every=4,
    callbacks=[pause],
)
state = history.engine.full_state_dict()  # every rank takes part in the gather
if history.engine.rank == 0:
    torch.save(
        {
            "losses": history.losses,
            "state": state,
            "world": history.engine.world_size,
            "plan": str(history.engine.plan),
            "world_changes": history.world_changes,
        },
        args.out,
    )
