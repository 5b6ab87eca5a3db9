"""The planner: memory and time of a plan before launching it, and the best plan.

    est = mf.estimate(model, "fsdp=8", batch_size=64, example_inputs=x, hardware="h100")
    est.memory.total, est.step_time.total, est.tokens_per_s
    result = mf.plan_search(model, 64, batch_size=512, example_inputs=x,
                            hardware=mf.planner.hardware("h100", nodes=8))
    print(result.table()); result.best.plan

The model may live on the `meta` device (`with torch.device("meta"): model = ...`): the
profile needs shapes only, so a 175B model plans on a laptop. The pieces: `profile`
(what the model costs per sample), `hardware` (what the devices do), `estimate` (one
plan), `search` (all of them).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshfit.plan import Plan
from meshfit.planner.estimate import Estimate, MemoryEstimate, TimeEstimate, estimate_profile
from meshfit.planner.hardware import PRESETS, Hardware, hardware, measure, this_machine
from meshfit.planner.profile import ModelProfile, profile_model
from meshfit.planner.search import SearchResult, profile_of, search_model

__all__ = [
    "PRESETS",
    "Estimate",
    "Hardware",
    "MemoryEstimate",
    "ModelProfile",
    "SearchResult",
    "TimeEstimate",
    "estimate",
    "hardware",
    "measure",
    "plan_search",
    "profile_model",
    "this_machine",
]


def estimate(
    model: nn.Module | ModelProfile,
    plan: Plan | str,
    *,
    batch_size: int,
    example_inputs: Any = None,
    hardware: Hardware | str | None = None,
    optimizer: str | float = "adamw",
    loss_fn: Any = None,
    example_targets: Any = None,
    world_size: int | None = None,
    compiled: bool = False,
    chunked_loss: bool | int = False,
) -> Estimate:
    """Memory per rank (`.memory`, the fullest rank; `.ranks`, every pipeline rank) and,
    with hardware, time per step (`.step_time`), `tokens_per_s` and whether it fits, for
    training `model` under `plan` with a global batch of `batch_size`.

    example_inputs: one batch of the model's inputs (any batch size: costs are per
        sample). hardware: a preset name ("a100-40gb", "a100-80gb", "h100", "h200"),
        "cpu", or a Hardware (without one, the optimizer's step is counted as the CPU
        runs it: one parameter at a time, with its temporaries). optimizer: "adamw",
        "sgd", "sgd-momentum", ... ("adamw" is meshfit's, fused on a GPU; another name
        steps as torch's default: a list at a time on a GPU; one parameter at a time on
        the CPU), or with how it steps: "adamw:foreach", ":for-loop", ":fused"; or its
        state bytes per parameter. world_size:
        resolves dp=auto when hardware does not; with neither, a plan that leaves dp
        open ("fsdp=64") means dp=1, and the Estimate's notes say so. compiled,
        chunked_loss: the run will use parallelize(..., compile=True, chunked_loss=...)."""
    from meshfit.planner.hardware import hardware as get_hardware

    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    traced = plan.precision if compiled else None
    profile = profile_of(model, example_inputs, loss_fn, example_targets, traced)
    hw = get_hardware(hardware) if hardware is not None else None
    notes = []
    if plan.dp is None and world_size is None and hw is None:
        plan = plan.resolve(plan.processes_per_replica)
        notes.append(
            f"dp not given: estimated with dp=1, {plan.world_size} devices (pass world_size= "
            f"or hardware= to fill more with data parallelism)"
        )
    elif plan.dp is None and world_size is not None:
        plan = plan.resolve(world_size)
    result = estimate_profile(
        profile,
        plan,
        batch_size=batch_size,
        hardware=hw,
        optimizer=optimizer,
        compiled=compiled,
        chunked_loss=chunked_loss,
    )
    result.notes[:0] = notes
    return result


def plan_search(
    model: nn.Module | ModelProfile,
    world_size: int,
    *,
    batch_size: int,
    example_inputs: Any = None,
    hardware: Hardware | str | None = None,
    optimizer: str | float = "adamw",
    precision: str = "fp32",
    loss_fn: Any = None,
    example_targets: Any = None,
    offload: bool = True,
    compiled: bool = False,
    chunked_loss: bool | int = False,
) -> SearchResult:
    """Every plan of `world_size` devices ranked by predicted throughput (`.ranked`, best
    first; `.dropped` with the reasons; `.table()` to print). hardware: as in
    `estimate`; its node size decides which groups cross nodes. precision is kept as
    given (the planner does not change the numbers a run computes)."""
    from meshfit.planner.hardware import hardware as get_hardware

    if isinstance(hardware, Hardware):
        hw = hardware
    elif hardware is None or hardware == "cpu":
        hw = this_machine(world_size)
    else:
        preset = get_hardware(hardware)
        nodes = max(1, -(-world_size // preset.devices_per_node))
        hw = preset.with_nodes(nodes, min(preset.devices_per_node, world_size))
    return search_model(
        model,
        example_inputs,
        world_size,
        loss_fn=loss_fn,
        example_targets=example_targets,
        batch_size=batch_size,
        hardware=hw,
        optimizer=optimizer,
        precision=precision,
        offload=offload,
        compiled=compiled,
        chunked_loss=chunked_loss,
    )
