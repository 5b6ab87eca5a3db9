"""Prints the plan its parallelize(model, None) got (meshfit run --plan sets it)."""

import torch

import meshfit as mf

engine = mf.parallelize(torch.nn.Linear(2, 2), None, loss_fn=torch.nn.functional.mse_loss)
if engine.rank == 0:
    print(f"plan: {engine.plan}")
