"""`plan="auto"`: the planner's best plan for this job, chosen the same on every rank.

Every rank profiles the model and searches on its own: the profile is computed on meta
tensors (the same on every rank), and the hardware comes from device properties, not
from timings (`hardware.this_machine`), so every rank arrives at the same plan without
talking to the others (the process group does not exist yet: the plan decides its mesh).

"auto" may fix some fields, which the search then keeps: "auto,precision=bf16",
"auto,checkpointing=full", "auto,pp=1".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.plan import Plan, is_auto  # noqa: F401 (is_auto lived here before 2026-11-23)
from meshfit.planner.estimate import Estimate, _gib
from meshfit.planner.hardware import Hardware, this_machine
from meshfit.planner.search import SearchResult, search_model


def fixed_fields(plan: str) -> dict[str, Any]:
    """The fields "auto,precision=bf16,..." fixes."""
    rest = ",".join(plan.replace(" ", "").split(",")[1:])
    if not rest:
        return {}
    given = Plan.parse(rest)
    default = Plan()
    return {
        f.name: getattr(given, f.name)
        for f in fields(Plan)
        if getattr(given, f.name) != getattr(default, f.name)
    }


@dataclasses.dataclass
class AutoChoice:
    """What plan="auto" chose, its prediction, and the search it came from."""

    plan: Plan
    estimate: Estimate
    result: SearchResult

    def describe(self) -> str:
        e = self.estimate
        line = (
            f"plan=auto chose {self.plan} (best of {len(self.result.ranked)} that fit; "
            f"{len(self.result.dropped)} dropped): predicted {_gib(e.memory.total)} per rank"
        )
        if e.step_time is not None:
            line += f", {e.step_time.total * 1e3:.1f} ms a step"
        line += f" on {self.result.hardware.source if self.result.hardware else '?'}"
        compiled = [n for n in e.notes if n.startswith("compiled memory counted as eager")]
        return line + "".join(f" ({n})" for n in compiled)

    def as_record(self) -> dict[str, Any]:
        e = self.estimate
        record: dict[str, Any] = {"plan": str(self.plan), "memory_bytes": e.memory.total}
        if e.step_time is not None:
            record["step_time_s"] = e.step_time.total
        return record


def choose_plan(
    model: nn.Module,
    plan: str,
    *,
    batch_size: int,
    example_inputs: Any,
    example_targets: Any = None,
    loss_fn: Any = None,
    optimizer: Any = None,
    compiled: bool = False,
    chunked_loss: bool | int = False,
    world_size: int | None = None,
    hardware: Hardware | None = None,
) -> AutoChoice:
    """The best plan for `model` on this job's processes (WORLD_SIZE, as torchrun and
    mf.launch set it) for a global batch of `batch_size`."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    hw = hardware or this_machine(per_node)
    if hw.devices_per_node != per_node or hw.nodes * hw.devices_per_node != world:
        hw = hw.with_nodes(max(1, world // per_node), per_node)
    fixed = fixed_fields(plan)
    result = search_model(
        model,
        example_inputs,
        world,
        loss_fn=loss_fn,
        example_targets=example_targets,
        batch_size=batch_size,
        hardware=hw,
        optimizer=optimizer_for_planning(optimizer, hw),
        precision=fixed.get("precision", "fp32"),
        compiled=compiled,
        chunked_loss=chunked_loss,
    )
    if fixed:
        keep = [e for e in result.ranked if all(getattr(e.plan, k) == v for k, v in fixed.items())]
        if not keep:
            raise MeshfitError(
                f"plan={plan!r}: no plan with {fixed_text(fixed)} fits {world} process(es) "
                f"for a batch of {batch_size}; drop a fixed field or change the batch size"
            )
        result = dataclasses.replace(result, ranked=keep)
    best = result.best
    return AutoChoice(best.plan, best, result)


def fixed_text(fixed: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items())


def optimizer_state_bytes(factory: Any) -> float:
    """Bytes of state per parameter of the optimizer `factory` builds, found by building
    it on one parameter and taking a step (its state then exists): Adam's two moments 8,
    SGD with momentum 4, plain SGD 0. Default (no factory): meshfit's AdamW."""
    return _probe(factory)[1]


def optimizer_for_planning(factory: Any, hardware: Hardware | None = None) -> str | float:
    """What the planner takes as `optimizer=`: the name of a torch optimizer it knows
    (memory.OPTIMIZER_STATE_BYTES) with how it steps ("adamw:foreach", which sets its
    step's temporaries), else its state bytes per parameter. The factory's own
    `foreach=`/`fused=`, else torch's default for the device: a list at a time on a GPU
    (`hardware` with its own memory), one parameter at a time on the CPU. Default (no
    factory): "adamw", meshfit's (fused on a GPU)."""
    from meshfit.options import default_optimizer
    from meshfit.planner.memory import OPTIMIZER_STATE_BYTES

    if factory is None or factory is default_optimizer:
        return "adamw"
    # probed where it will run when this machine has such a GPU (a factory may choose
    # by device, as meshfit's own does); else on the CPU
    on_gpu = hardware is not None and hardware.separate_host_memory
    name, state_bytes, defaults = _probe(factory, on_gpu and torch.cuda.is_available())
    if name == "sgd" and state_bytes:
        name = "sgd-momentum"
    if OPTIMIZER_STATE_BYTES.get(name) != state_bytes:
        return state_bytes
    if defaults.get("fused"):
        return f"{name}:fused"
    foreach = defaults.get("foreach")
    if foreach is None:  # torch's choice (_default_to_fused_or_foreach): by the device
        foreach = on_gpu
    return f"{name}:{'foreach' if foreach else 'for-loop'}"


def _probe(factory: Any, cuda: bool = False) -> tuple[str, float, dict[str, Any]]:
    """(the optimizer's class name in lower case, its state bytes per parameter, its
    defaults), by building it on one parameter (on the GPU with `cuda`) and taking a
    step (its state then exists)."""
    if factory is None:
        return "adamw", 8.0, {}
    probe = nn.Parameter(torch.zeros(4, device="cuda" if cuda else "cpu"))
    try:
        optimizer = factory([probe])
        probe.grad = torch.ones_like(probe)
        optimizer.step()
    except Exception:  # an optimizer that needs more (a closure, named groups): assume Adam
        return "", 8.0, {}
    state = optimizer.state.get(probe, {})
    total = sum(
        v.numel() * v.element_size()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )
    return type(optimizer).__name__.lower(), total / probe.numel(), dict(optimizer.defaults)
