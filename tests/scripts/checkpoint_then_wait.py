"""fit with checkpoints for 4 steps, then wait to be stopped (a scheduler's SIGTERM)."""

import os
import sys
import time

import torch
import torch.nn.functional as F

import meshfit as mf

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
data = (torch.randn(64, 8), torch.randn(64, 4))
root = sys.argv[1]
mf.fit(model, data, loss_fn=F.mse_loss, batch_size=8, max_steps=4, checkpoint_dir=root,
       checkpoint_every=2, progress=False)  # fmt: skip
open(os.path.join(root, f"done-{os.environ['RANK']}"), "w").close()
time.sleep(600)
