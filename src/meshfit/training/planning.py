"""A run's plan and speed: how the run measured against the planner's choice for
plan="auto" (prepare.py makes it), the MFU meter, and the start-up lines.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshfit.engine import Engine
from meshfit.runtime.examples import Examples
from meshfit.topology import Topology
from meshfit.training.progress import TrainingDisplay
from meshfit.training.resume import Start


def mfu_meter(
    model: nn.Module, topology: Topology, examples: Examples, loss_fn: Any, profile: Any = None
) -> Callable[[float], float] | None:
    """samples/s -> MFU over every device of the job, where their peak is known."""
    from meshfit.planner.mfu import peak_flops, training_flops_per_sample

    peak = peak_flops(topology.device, topology.plan.precision)
    if peak is None:
        return None
    batch = examples.first(1)
    if batch is None:
        return None
    flops = training_flops_per_sample(model, *batch[:1], loss_fn, batch[1], profile)
    if flops is None:
        return None
    world = topology.plan.world_size or 1
    return lambda samples_per_s: flops * samples_per_s / (world * peak)


def measured_against_plan(
    auto: Any, records: list[dict[str, Any]], batch_size: int, engine: Engine
) -> dict[str, Any]:
    """The run's measured step time (median over the logged rates after the first, which
    holds start-up) and, on a GPU, peak memory, beside what the planner predicted."""
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")]
    measured: dict[str, Any] = {}
    if rates:
        rates = rates[1:] or rates
        measured["measured_step_time_s"] = batch_size / statistics.median(rates)
    if engine.device.type == "cuda":
        measured["measured_memory_bytes"] = torch.cuda.max_memory_allocated(engine.device)
    return measured


def closed_loop_line(planned: dict[str, Any]) -> str:
    parts = []
    if "step_time_s" in planned and "measured_step_time_s" in planned:
        predicted, measured = planned["step_time_s"], planned["measured_step_time_s"]
        parts.append(
            f"step time predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms "
            f"(x{measured / predicted:.2f})"
        )
    if "measured_memory_bytes" in planned:
        predicted, measured = planned["memory_bytes"], planned["measured_memory_bytes"]
        parts.append(
            f"memory per rank predicted {predicted / 2**30:.2f} GiB, peak "
            f"{measured / 2**30:.2f} GiB (x{measured / predicted:.2f})"
        )
    else:
        parts.append(f"memory per rank predicted {planned['memory_bytes'] / 2**30:.3f} GiB")
    return "the planner's prediction against this run: " + "; ".join(parts)


def announce_run(
    display: TrainingDisplay,
    engine: Engine,
    batch_size: int,
    steps_per_epoch: int,
    total_steps: int,
    start: Start,
) -> None:
    """Print the run's opening lines: plan, workers, model size, batch split, length."""
    params = engine.num_parameters
    where = f"{engine.world_size} {'GPU' if engine.device.type == 'cuda' else 'CPU'} worker(s)"
    per_rank = engine.topology.local_batch(batch_size)
    micro = engine.plan.num_microbatches
    split = f"{engine.dp_size} rank(s) x {per_rank}"
    if micro > 1:
        split += f" ({micro} micro-batches of {per_rank // micro})"
    display.print(
        f"meshfit: plan {engine.plan} on {where} | model {params / 1e6:.2f}M parameters | "
        f"global batch {batch_size} = {split} | {steps_per_epoch} steps/epoch, "
        f"training {total_steps} steps"
    )
    if engine.planned is not None:
        display.print(f"meshfit: {engine.planned.describe()}")
    for note in engine.topology.notes:
        display.print(f"meshfit: {note}")
    if engine.runner.describe():
        display.print(f"meshfit: {engine.runner.describe()}")
    if engine.tp_report is not None:
        split = engine.tp_report.describe()
        if split:
            display.print(f"meshfit: {split}")
    if start.checkpoint:
        display.print(
            f"meshfit: resumed from {start.checkpoint} (step {engine.step_count}): kept the "
            f"weights, optimizer state, data order (batch size, seed, shuffle) and RNG; "
            + (f"changed: {', '.join(start.changes)}" if start.changes else "no setting changed")
        )
