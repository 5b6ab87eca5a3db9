"""The step-timing loop the multi-worker benchmarks share (planner_ranking.py,
cluster_bandwidth.py): a GPT under a plan, warmed up, then steps timed barrier to barrier
on every rank (the slowest rank's time is the step's)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss


def warm_gpt_engine(config: GPTConfig, plan: str, batch_size: int) -> tuple[mf.Engine, tuple]:
    """A GPT from seed 0 under `plan` with AdamW, and one fixed batch, after two steps
    (allocations, DDP buckets, gloo connections)."""
    torch.manual_seed(0)
    engine = mf.parallelize(
        GPT(config),
        plan,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=next_token_loss,
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    for _ in range(2):
        engine.step(batch)
    return engine, batch


def timed_steps(engine: mf.Engine, batch: tuple, steps: int) -> list[float]:
    """This rank's time of each of `steps` steps, from a barrier before to one after."""
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        engine.step(batch)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times
