"""What a pipeline stage costs, and the cut points that balance the stages.

Costs are measured forward times of each block on an example batch (rank 0 times them
and tells the others, so every rank cuts at the same place) or, without one, parameter
counts. `balanced_starts` picks the contiguous cut that makes the costliest stage as
cheap as possible.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import BlockStack
from meshfit.trees import call_model


@dataclass
class StageCosts:
    """What the cut points were balanced on, per block (seconds or parameters)."""

    unit: str  # "s" (measured forward time) or "params"
    blocks: list[float]
    head: float = 0.0  # before the first block (goes to the first stage)
    tail: float = 0.0  # after the last block (goes to the last stage)
    activation_bytes: list[int] = field(default_factory=list)
    # Which blocks hold parameters: every stage needs one (an optimizer needs something to
    # step). Empty means all do.
    trainable: list[bool] = field(default_factory=list)


def balanced_starts(costs: StageCosts, num_stages: int) -> list[int]:
    """Index of the first block of every stage, chosen so the costliest stage is as
    cheap as possible (exact: dynamic programming over contiguous splits)."""
    n = len(costs.blocks)
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, lo: int, hi: int) -> float:
        extra = (costs.head if stage == 0 else 0.0) + (
            costs.tail if stage == num_stages - 1 else 0.0
        )
        if costs.trainable and not any(costs.trainable[lo:hi]):
            return float("inf")  # a stage of parameter-free blocks (e.g. only a Tanh)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: the best split of blocks[:i] into s+1 stages, scored by (costliest
    # stage, sum of squared stage costs): the second breaks ties towards even stages.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    choice = [[0] * (n + 1) for _ in range(num_stages)]
    for i in range(1, n + 1):
        c = stage_cost(0, 0, i)
        best[0][i] = (c, c * c)
    for s in range(1, num_stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                c = stage_cost(s, j, i)
                value = (max(best[s - 1][j][0], c), best[s - 1][j][1] + c * c)
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    if best[num_stages - 1][n][0] == float("inf"):
        raise MeshfitError(
            f"cannot give each of {num_stages} pipeline stages a block with parameters: only "
            f"{sum(costs.trainable)} of the {n} blocks have any; use fewer stages"
        )
    starts, i = [], n
    for s in range(num_stages - 1, 0, -1):
        i = choice[s][i]
        starts.append(i)
    return [0, *reversed(starts)]


def stage_costs_of(costs: StageCosts, starts: list[int]) -> list[float]:
    bounds = [*starts, len(costs.blocks)]
    totals = [sum(costs.blocks[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    totals[0] += costs.head
    totals[-1] += costs.tail
    return totals


def parameter_costs(stack: BlockStack, head: list[tuple], tail: list[tuple]) -> StageCosts:
    """Costs by parameter count: the blocks', and the (module, name, parameter) entries
    before (`head`) and after (`tail`) them."""
    return StageCosts(
        unit="params",
        trainable=_trainable(stack),
        blocks=[float(sum(p.numel() for p in b.parameters())) for b in stack.blocks],
        head=float(sum(p.numel() for _, _, p in head)),
        tail=float(sum(p.numel() for _, _, p in tail)),
    )


def _measures_with_rank0(model: nn.Module) -> bool:
    """Whether this rank runs the timing forward: rank 0 alone, unless the blocks are
    already tensor-parallel; then a forward is collective over the tp group, so rank 0's
    whole tp group runs it together (rank 0 alone would wait for its peers forever)."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)  # a DTensor's mesh: the tp mesh
        if mesh is not None:
            return 0 in mesh.mesh.flatten().tolist()
    return dist.get_rank() == 0


def measure_costs(
    model: nn.Module, stack: BlockStack, example_inputs: Any, repeats: int = 3
) -> StageCosts:
    """Time each block's forward (median of `repeats` runs after a warm-up) and count
    the bytes autograd saves in it for backward (the activation memory it costs)."""
    device = next(model.parameters()).device
    marks: dict[str, list[float]] = {}
    saved = dict.fromkeys(stack.keys, 0)
    current: list[str | None] = [None]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def before(key: str) -> Callable:
        def hook(module, args):
            sync()
            current[0] = key
            marks.setdefault(key, []).append(time.perf_counter())

        return hook

    def after(key: str) -> Callable:
        def hook(module, args, output):
            sync()
            marks[key].append(time.perf_counter())
            current[0] = None

        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            saved[current[0]] += t.numel() * t.element_size()
        return t

    handles = []
    for key, block in zip(stack.keys, stack.blocks, strict=True):
        handles.append(block.register_forward_pre_hook(before(key)))
        handles.append(block.register_forward_hook(after(key)))
    runs: list[tuple[list[float], float, float]] = []
    try:
        for attempt in range(repeats + 1):
            marks.clear()
            if attempt == 1:
                saved.update(dict.fromkeys(saved, 0))
            sync()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                call_model(model, example_inputs)
            sync()
            end = time.perf_counter()
            per_block = [marks[k][1] - marks[k][0] for k in stack.keys]
            runs.append(
                (per_block, marks[stack.keys[0]][0] - start, end - marks[stack.keys[-1]][1])
            )
    finally:
        for h in handles:
            h.remove()
    runs = runs[1:]  # drop the warm-up
    return StageCosts(
        unit="s",
        blocks=[statistics.median(r[0][i] for r in runs) for i in range(len(stack.keys))],
        head=statistics.median(r[1] for r in runs),
        tail=statistics.median(r[2] for r in runs),
        activation_bytes=[saved[k] // repeats for k in stack.keys],
        trainable=_trainable(stack),
    )


def _trainable(stack: BlockStack) -> list[bool]:
    return [any(p.requires_grad for p in b.parameters()) for b in stack.blocks]
