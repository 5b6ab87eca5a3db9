"""A model's initialisation as a list of calls, each one function on one module (what
materialize.py replays), and the slots that hold its tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


Call = tuple[str, InitFn, nn.Module]  # (what, function, the module it is called on)


Slot = tuple[nn.Module, str, str]  # (module, "param" / "buffer", name): where a tensor is held


def _persistent(slot: Slot) -> bool:
    module, kind, name = slot
    return kind == "param" or name not in module._non_persistent_buffers_set


def _key(slot: Slot) -> tuple[int, str]:
    return id(slot[0]), slot[2]


def _current(module: nn.Module, name: str) -> torch.Tensor | None:
    """What `module` holds under `name` now (a parameter, or a stand-in buffer)."""
    found = module._parameters.get(name)
    return found if found is not None else module._buffers.get(name)


def _table(module: nn.Module, kind: str) -> dict[str, Any]:
    return module._parameters if kind == "param" else module._buffers


def _own_slots(module: nn.Module) -> list[tuple[Slot, torch.Tensor]]:
    found = [((module, "param", n), t) for n, t in module._parameters.items() if t is not None]
    found += [((module, "buffer", n), t) for n, t in module._buffers.items() if t is not None]
    return found


def _reset(module: nn.Module) -> None:
    """What a layer's constructor runs: its reset_parameters, or for a library layer
    that initialises inline, the same draws (hf_init.INLINE_INITS)."""
    inline = INLINE_INITS.get(f"{type(module).__module__}.{type(module).__qualname__}")
    if inline is not None:
        inline(module)
        return
    reset = getattr(type(module), "reset_parameters", None)
    if callable(reset):
        reset(module)


def _post_order(model: nn.Module, skip: set[int] | None = None) -> list[nn.Module]:
    """Every module once, children before their parent (Module.apply's order), leaving
    out the subtrees of modules whose ids are in `skip`."""
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if skip and id(module) in skip:
            return
        for child in module.children():
            visit(child)
        if id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    visit(model)
    return order


def conv1d_init(module: nn.Module) -> None:
    nn.init.normal_(module.weight, std=0.02)  # transformers' Conv1D.__init__ (GPT-2)
    nn.init.zeros_(module.bias)


# Library layers whose constructors draw their initial values without reset_parameters.
INLINE_INITS: dict[str, InitFn] = {"transformers.pytorch_utils.Conv1D": conv1d_init}
