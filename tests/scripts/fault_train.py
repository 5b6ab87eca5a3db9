"""Trained by test_cli's fault test under `meshfit run --max-restarts 1`.

With --kill-at S, rank 1 SIGKILLs itself right after step S on the first attempt
(after the checkpoint at step S-1... whichever came last); the restarted workers resume
from the newest checkpoint and must end with the weights of an undisturbed run.
With --stall-at S --stall-marker PATH the last rank stops after step S instead (once),
so a test can kill its host (tests/test_cluster.py). The training itself is
`workers.fit_killed_once`, which mf.launch tests run too."""

import argparse

import torch
from workers import fit_killed_once

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--stall-at", type=int, default=None)
parser.add_argument("--stall-marker", default=None)
args = parser.parse_args()

result = fit_killed_once(args.checkpoint_dir, args.kill_at, args.stall_at, args.stall_marker)
if result.pop("rank") == 0:
    torch.save(result, args.out)
