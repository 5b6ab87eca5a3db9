"""Trained by test_cli's fault test under `meshfit run --max-restarts 1`.

With --kill-at S, rank 1 SIGKILLs itself right after step S on the first attempt
(after the checkpoint at step S-1... whichever came last); the restarted workers resume
from the newest checkpoint and must end with the weights of an undisturbed run.
With --stall-at S --stall-marker PATH the last rank stops after step S instead (once),
so a test can kill its host (tests/test_cluster.py)."""

import argparse
import os
import signal
import time

import torch
from workers import build, dataset, optimizer_factory

import meshfit as mf

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--stall-at", type=int, default=None)
parser.add_argument("--stall-marker", default=None)
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def kill_once(step: int, engine: mf.Engine) -> None:
    if args.kill_at == step and attempt == 0 and engine.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # --stall-at: the last rank writes the marker and waits there, for a test to kill
    # its whole host; a restarted host finds the marker and trains on (its own agent
    # counts its attempts from 0 again, so the attempt number cannot say it).
    last = engine.rank == engine.world_size - 1
    if args.stall_at == step and last and not os.path.exists(args.stall_marker):
        with open(args.stall_marker, "w") as f:
            f.write(str(step))
        time.sleep(600)


model, loss_fn = build("mlp")
history = mf.fit(
    model,
    dataset("mlp", 48),
    loss_fn=loss_fn,
    optimizer=optimizer_factory("adamw"),
    batch_size=8,
    max_steps=8,
    checkpoint_dir=args.checkpoint_dir,
    checkpoint_every=2,
    progress=False,
    callbacks=[kill_once],
)
if history.engine.rank == 0:
    torch.save(
        {"state": model.state_dict(), "attempt": attempt, "losses": history.losses}, args.out
    )
