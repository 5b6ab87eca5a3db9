"""Data-parallel training of your own model with meshfit, two ways.

    meshfit run --nproc 2 examples/train_dp.py            # 2 CPU workers (or all GPUs)
    python examples/train_dp.py                           # one process, same numbers

Part 1 drives the engine yourself (one call per step); part 2 lets mf.fit run the loop.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import meshfit as mf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size")
args = parser.parse_args()

# Any nn.Module. Seed first so every process builds the same initial weights.
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

# Some data: 3 classes that depend on the inputs (a real task would load files here).
g = torch.Generator().manual_seed(1)
inputs = torch.randn(4096, 20, generator=g)
targets = (inputs[:, :3].argmax(dim=1) + (inputs[:, 3] > 1).long()) % 3

# ---- 1. the engine: you own the loop ----------------------------------------------
engine = mf.parallelize(
    model,
    plan=None,  # dp over every process; or mf.Plan(dp=2, microbatches=2), or "dp=2,precision=bf16"
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    loss_fn=F.cross_entropy,
    grad_clip=1.0,
)
for step in range(args.steps):
    rows = torch.randint(0, len(inputs), (args.batch_size,), generator=g)
    loss = engine.step((inputs[rows], targets[rows]))  # the GLOBAL batch, same on every rank
    if engine.rank == 0 and step % 10 == 0:
        print(f"engine step {step:3d}  loss {float(loss):.4f}")

# ---- 2. fit: meshfit owns the loop (sharding, progress, history, checkpoints) ------
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
history = mf.fit(
    model,
    (inputs, targets),
    loss_fn=F.cross_entropy,
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    batch_size=args.batch_size,
    max_steps=args.steps,
    log_every=10,
)
if history.engine.rank == 0:
    print(f"fit: loss {history.losses[0]:.4f} -> {history.final_loss:.4f}")
