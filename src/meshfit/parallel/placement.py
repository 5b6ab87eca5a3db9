"""Device placement: one model spread over the devices of ONE process.

`mf.place(model, {"encoder": "cuda:0", "decoder": "cuda:1"})` moves each named
submodule to its device and adds hooks that move every submodule's inputs to the device
it lives on, so `forward` needs no `.to(...)` calls: the classic "model parallel on two
GPUs" of the tutorials, without touching the model's code. The model's output comes back
on the device its input came from, so the loss and targets need no care either.

A module's own code must not mix tensors from two devices: put modules whose outputs
are combined (e.g. token and position embeddings that are added) on one device.

This is the simple option: the devices take turns (one computes while the others wait).
`Plan(pp=N)` is the scalable one: it keeps every device busy with micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from meshfit.errors import MeshfitError

PLACEMENT_ATTR = "_meshfit_placement"


def place(
    model: nn.Module, placement: dict[str, str | torch.device], default: str | None = None
) -> nn.Module:
    """Put each submodule named in `placement` on its device; returns `model`.

    placement: {submodule name (as in model.named_modules()): device}. A name covers
        everything under it; a more specific name wins ("blocks": "cuda:0",
        "blocks.5": "cuda:1").
    default: device for what no name covers (default: where it already is).
    """
    if not isinstance(model, nn.Module):
        raise MeshfitError(f"place needs a torch.nn.Module, not {type(model).__name__}")
    if not placement:
        raise MeshfitError("place needs at least one {submodule name: device} entry")
    modules = dict(model.named_modules())
    devices = {name: _device(name, device) for name, device in placement.items()}
    for name in devices:
        if name not in modules:
            top = ", ".join(n for n in modules if n and "." not in n)
            raise MeshfitError(
                f"place: the model has no submodule {name!r}; its top-level submodules "
                f"are: {top} (names as in model.named_modules())"
            )
    if default is not None:
        model.to(_device("default", default))
    # Parents first, so a more specific name moves its part after its parent did.
    for name in sorted(devices, key=lambda n: n.count(".") + (n != "")):
        modules[name].to(devices[name])
    model.register_forward_pre_hook(_remember_input_device, with_kwargs=True)
    _hook_single_device_parts(model)
    model.register_forward_hook(_return_to_input_device)
    setattr(model, PLACEMENT_ATTR, {n: str(d) for n, d in devices.items()})
    return model


def _hook_single_device_parts(module: nn.Module) -> None:
    """Give every largest submodule whose weights all sit on one device a hook that moves
    its inputs there, so its own code (residual adds included) sees one device."""
    found = {t.device for t in (*module.parameters(), *module.buffers())}
    # A ModuleList/ModuleDict is iterated, never called: its hooks would not run.
    if len(found) == 1 and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        module.register_forward_pre_hook(_move_inputs(found.pop()), with_kwargs=True)
        return
    for child in module.children():
        _hook_single_device_parts(child)


def _device(name: str, device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise MeshfitError(
            f"place: {device!r} (for {name!r}) is not a device; use e.g. 'cpu', 'cuda:0'"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else 0
        if index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count)) or "no GPU"
            raise MeshfitError(
                f"place: {name!r} is placed on {device}, but this process sees {have} "
                f"(check CUDA_VISIBLE_DEVICES or `meshfit devices`)"
            )
        device = torch.device("cuda", index)
    return device


def _move(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _move_inputs(device: torch.device):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _move(args, device), _move(kwargs, device)

    return hook


def _first_tensor_device(tree: Any) -> torch.device | None:
    found: list[torch.device] = []
    tree_map(lambda t: found.append(t.device) if isinstance(t, torch.Tensor) else None, tree)
    return found[0] if found else None


def _remember_input_device(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module._meshfit_input_device = _first_tensor_device((args, kwargs))


def _return_to_input_device(module: nn.Module, args: tuple, output: Any) -> Any:
    device = getattr(module, "_meshfit_input_device", None)
    return output if device is None else _move(output, device)


def is_placed(model: nn.Module) -> bool:
    return hasattr(model, PLACEMENT_ATTR)
