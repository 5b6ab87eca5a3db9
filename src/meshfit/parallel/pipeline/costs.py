"""What a pipeline stage costs, and the cut points that balance the stages.

Costs are each block's forward FLOPs on an example batch (matrix products, convolutions,
attention and MoE experts' grouped products, counted by torch's FlopCounterMode with
parallel/flop_counts.py's formulas: rank 0 counts them and tells the others) or, without
one, parameter counts. Both are properties of the model and the
batch's shape, never of the machine's load: a cut on measured time moved with timing
noise, and with it the random numbers each stage's dropout draws, so the same script
and seed trained another run on a busy machine. A block without FLOPs
counts its parameters, as the planner's cut does. `balanced_starts` picks the
contiguous cut that makes the costliest stage as cheap as possible, among the starts
where a stage's own loop gives its blocks their own arguments (`starts_keeping_arguments`:
the same example forward records what each block is given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.parallel.batchnorm import local_statistics
from meshfit.parallel.blocks import BlockStack
from meshfit.parallel.flop_counts import flop_counter
from meshfit.parallel.pipeline.arguments import allowed_starts, tokens
from meshfit.trees import call_model


@dataclass
class StageCosts:
    """What the cut points were balanced on, per block (seconds or parameters)."""

    unit: str  # "flops" (forward FLOPs on the example batch) or "params"
    blocks: list[float]
    head: float = 0.0  # before the first block (goes to the first stage)
    tail: float = 0.0  # after the last block (goes to the last stage)
    activation_bytes: list[int] = field(default_factory=list)
    # Which blocks hold parameters: every stage needs one (an optimizer needs something to
    # step). Empty means all do.
    trainable: list[bool] = field(default_factory=list)
    # What the forward's loop gives each block besides the hidden state, as tokens: the
    # same token for the same object (a mask, a rotary table), else the value
    # (arguments.py). Empty when unknown (no example forward).
    arguments: list[dict[tuple[str, Any], Any]] = field(default_factory=list)
    differing: str = ""  # the first block whose arguments differ from block 0's, said


def balanced_starts(
    costs: StageCosts, num_stages: int, allowed: list[bool] | None = None
) -> list[int]:
    """Index of the first block of every stage, chosen so the costliest stage is as
    cheap as possible (exact: dynamic programming over contiguous splits), among the
    starts `allowed` (starts_keeping_arguments; default: any)."""
    n = len(costs.blocks)
    allowed = allowed or [True] * n
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
                if not allowed[j]:
                    continue
                c = stage_cost(s, j, i)
                value = (max(best[s - 1][j][0], c), best[s - 1][j][1] + c * c)
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    if best[num_stages - 1][n][0] == float("inf") and not all(allowed):
        raise MeshfitError(
            f"pipeline parallel cannot cut this model into {num_stages} stages: its forward "
            f"gives each block arguments by the block's place in its loop (a mask or rotary "
            f"table per layer type: {costs.differing}), and a stage's loop counts its own "
            f"blocks from 0, so a stage may start only where the blocks' arguments repeat "
            f"the first blocks' ({_listed(allowed)}), which leaves no {num_stages} stages "
            f"with parameters; use fewer stages, or train without pp"
        )
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


def _listed(allowed: list[bool]) -> str:
    starts = [i for i, ok in enumerate(allowed) if ok and i > 0]
    if not starts:
        return "no block after the first does"
    return "blocks " + ", ".join(map(str, starts[:12])) + (", ..." if len(starts) > 12 else "")


def count_costs(model: nn.Module, stack: BlockStack, example_inputs: Any) -> StageCosts:
    """Each block's forward FLOPs on `example_inputs` (a block with none: its parameter
    count), the FLOPs before and after the blocks, and the bytes autograd saves in each
    block for backward (the activation memory it costs). One forward; the same numbers
    on any machine, however busy."""
    counter = flop_counter()  # the grouped products of MoE experts counted too
    saved = dict.fromkeys(stack.keys, 0)
    flops: dict[str, float] = {}
    current: list[str] = ["head"]

    def total() -> float:
        return float(sum(counter.get_flop_counts().get("Global", {}).values()))

    def switch(to: str) -> None:
        now = total()
        flops[current[0]] = flops.get(current[0], 0.0) + now - flops.get("_at", 0.0)
        flops["_at"] = now
        current[0] = to

    arguments: dict[str, dict] = {}
    objects: list[Any] = []  # held, so no id is reused during the forward

    def before(key: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            switch(key)
            arguments.setdefault(key, tokens(args, kwargs, objects))  # what it is given

        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] in saved:
            saved[current[0]] += t.numel() * t.element_size()
        return t

    # What the forward runs between two blocks runs on the earlier one's stage
    # (stage.py): it counts with that block, until the next block starts.
    handles = [
        block.register_forward_pre_hook(before(key), with_kwargs=True)
        for key, block in zip(stack.keys, stack.blocks, strict=True)
    ]
    handles.append(stack.blocks[-1].register_forward_hook(lambda *_: switch("tail")))
    try:
        with (
            counter,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            local_statistics(model),  # rank 0 alone runs this forward
        ):
            call_model(model, example_inputs)
            switch("tail")
    finally:
        for h in handles:
            h.remove()
    return StageCosts(
        unit="flops",
        blocks=[
            flops.get(k) or float(sum(p.numel() for p in b.parameters()))
            for k, b in zip(stack.keys, stack.blocks, strict=True)
        ],
        head=flops.get("head", 0.0),
        tail=flops.get("tail", 0.0),
        activation_bytes=[saved[k] for k in stack.keys],
        trainable=_trainable(stack),
        arguments=[arguments.get(k, {}) for k in stack.keys],
    )


def starts_keeping_arguments(costs: StageCosts, carried: dict[str, list] | None) -> list[bool]:
    """For each block index, whether a stage may start there (arguments.py); the first
    block whose arguments differ is kept in `costs.differing` for a refusal."""
    allowed, costs.differing = allowed_starts(costs.arguments, len(costs.blocks), carried)
    return allowed


def _trainable(stack: BlockStack) -> list[bool]:
    return [any(p.requires_grad for p in b.parameters()) for b in stack.blocks]
