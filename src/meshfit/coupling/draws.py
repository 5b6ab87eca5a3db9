"""Random draws held still for the coupling probe (coupling/probe.py): dropout as identity,
every element-wise draw at one value, and where the model drew, for start-up to say.

A model that draws in training (dropout, drop-path, Phi-3.5-MoE's Gumbel routing) draws
other numbers for a sample over the whole batch than over a half (the same random state,
other shapes); the probe would read that as a coupling. Held still, the halves and the
whole compute the same function of each sample.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_DROPOUTS = {
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    torch.dropout,
    torch.Tensor.bernoulli_,
}


def _held(args: tuple, kwargs: dict, at: int, name: str, default: float) -> float:
    """A random draw's parameter, positional (`at`) or by keyword."""
    return float(args[at] if len(args) > at else kwargs.get(name, default))


def _lowest(args: tuple, kwargs: dict) -> float:
    """randint's low: its first argument where two integers lead (low, high), else 0."""
    ints = [a for a in args[:2] if isinstance(a, int)]
    return float(ints[0] if len(ints) == 2 else kwargs.get("low", 0))


# Random draws element by element (noise, Gumbel samples, Heun's coin of Phi-3.5-MoE's
# router), held at one value each, whatever the batch: a draw over the whole batch and
# one over a half give a sample other numbers (the same random state, other shapes), so
# a model that draws in training read as coupled: Phi-3.5-MoE (transformers' PhiMoE:
# jitter noise, Gumbel sampling of its experts) was refused under dp and fsdp as "the
# loss couples the samples" (3.1e-5 apart). Integers held at their lowest value: an
# index drawn to pair samples then points at another sample in a half than in the
# whole, and the coupling still shows; randperm and multinomial are left as they draw.
_DRAWS_HELD: dict[Any, Callable[[tuple, dict], float]] = {
    torch.Tensor.uniform_: lambda a, k: (
        (_held(a, k, 1, "from", 0.0) + _held(a, k, 2, "to", 1.0)) / 2
    ),
    torch.Tensor.normal_: lambda a, k: _held(a, k, 1, "mean", 0.0),
    torch.Tensor.exponential_: lambda a, k: 1.0 / _held(a, k, 1, "lambd", 1.0),
    torch.Tensor.cauchy_: lambda a, k: _held(a, k, 1, "median", 0.0),
    torch.rand: lambda a, k: 0.5,
    torch.rand_like: lambda a, k: 0.5,
    torch.randn: lambda a, k: 0.0,
    torch.randn_like: lambda a, k: 0.0,
    torch.randint: lambda a, k: _lowest(a, k),
    torch.randint_like: lambda a, k: _lowest(a[1:], k),
}


class HeldDraws(TorchFunctionMode):
    """Dropout as identity (and attention's dropout_p as 0), and every element-wise
    random draw held at one value (`_DRAWS_HELD`): the halves and the whole then compute
    the same function of each sample. `draws`: where each held draw was made, once."""

    def __init__(self, draws: list[str] | None = None) -> None:
        super().__init__()
        self.draws = draws

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            if func is torch.Tensor.bernoulli_:  # drop-path: keep everything
                return args[0].fill_(1.0)
            return args[0]
        held = _DRAWS_HELD.get(func)
        # a draw from a generator its caller seeds (the probe's own fingerprints) is
        # the same in every pass already
        if held is not None and kwargs.get("generator") is None:
            if self.draws is not None:
                site = _call_site(func)
                if site not in self.draws:
                    self.draws.append(site)
            value = held(args, kwargs)
            out = func(*args, **kwargs)  # its shape, dtype and device, as drawn
            with torch.no_grad():
                return out.fill_(value)
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p"):
            kwargs = {**kwargs, "dropout_p": 0.0}
        elif func is F.scaled_dot_product_attention and len(args) > 4 and args[4]:
            args = (*args[:4], 0.0, *args[5:])
        return func(*args, **kwargs)


def _call_site(func: Any) -> str:
    """`torch.rand at modeling_phimoe.py:120 (sparsemixer)`: the draw and the first
    frame of the stack outside torch and meshfit (the model's code that drew)."""
    short = getattr(func, "__name__", str(func))
    method = getattr(func, "__qualname__", "").startswith(("Tensor", "TensorBase"))
    name = f"Tensor.{short}" if method else f"torch.{short}"
    for frame in reversed(traceback.extract_stack()[:-2]):
        if os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS):
            continue
        return f"{name} at {os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return name


# torch's and meshfit's own directories: a draw's site is the first frame outside them
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules["meshfit"])
)
