"""A first script as other trainers teach it: the save under a rank guard (meshfit's
saves are collectives, every rank gives its part); or, with "raise", rank 0 raising an
error of its own (not meshfit's)."""

import sys

import torch
import torch.nn.functional as F

import meshfit as mf

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
engine = mf.parallelize(model, "fsdp=2", loss_fn=F.mse_loss)
engine.step((torch.randn(4, 8), torch.randn(4, 4)))
if engine.rank == 0:
    if sys.argv[2:] == ["raise"]:
        raise RuntimeError("an error of the script's own")
    engine.save_model(sys.argv[1])
