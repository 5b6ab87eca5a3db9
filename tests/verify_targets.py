"""Models, batches and losses for tests/test_verify.py, in a module so that worker
processes can import them (mf.verify pickles them; meshfit verify imports them by name)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def small_mlp(hidden: int = 32) -> torch.nn.Module:
    """A fresh small model in float64 (verify seeds before each call)."""
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 5)
    ).double()


def small_batch(size: int = 8, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 8, generator=g, dtype=torch.float64)
    return inputs, torch.randint(0, 5, (size,), generator=g)


def loss_wrong_on_rank_1(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with its value unchanged but its gradient one part in a million too
    large on rank 1 only: a bug in one replica's share that leaves every reported loss
    of the first step as it was. Only the comparison of weights and later losses can
    see it."""
    loss = F.cross_entropy(outputs, targets)
    if os.environ.get("RANK") == "1":
        loss = loss + 1e-6 * (loss - loss.detach())
    return loss


def model_and_batch() -> tuple:
    """The `meshfit verify` contract: (model or model builder, batch, loss_fn)."""
    return small_mlp, small_batch(), F.cross_entropy


def model_and_batch_with_options() -> tuple:
    """The 4-item form: a model (not a builder), and mf.parallelize options."""
    return small_mlp(), small_batch(), lambda out, y: F.cross_entropy(out, y), {"grad_clip": 1.0}
