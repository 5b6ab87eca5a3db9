"""A model's buffers as they were: saved by name, put back by name.

The coupling probe runs training forwards that must leave nothing behind, and some
forwards replace a buffer rather than write into it (I-BERT's `self.x_min =
torch.min(self.x_min, x_min)`: the module's `_buffers` then holds a new tensor). Saving
the tensors and copying back into them left such a buffer at the probe's value; saving
(module, name) puts the original tensor back in its place with its values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def is_broadcast(t: torch.Tensor) -> bool:
    """A tensor expanded from one element (a stride-0 dimension: a pipeline stage's
    placeholder for a weight another stage trains: pipeline/cut.py): it cannot be written."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True))


def _writable(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(module's name, module, buffer's name, buffer) for every buffer that can be written."""
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not is_broadcast(buffer):
                yield module_name, module, name, buffer


class SavedBuffers:
    """Every writable buffer of `model` by qualified name, saved at construction."""

    def __init__(self, model: nn.Module) -> None:
        self._slots: dict[str, tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = {}
        for module_name, module, name, buffer in _writable(model):
            qualified = f"{module_name}.{name}" if module_name else name
            self._slots[qualified] = (module, name, buffer, buffer.detach().clone())

    def saved(self) -> dict[str, torch.Tensor]:
        """The saved values, by name."""
        return {name: slot[3] for name, slot in self._slots.items()}

    def current(self) -> dict[str, torch.Tensor]:
        """The values the model holds now (replaced buffers included), by name."""
        now = {}
        for name, (module, attr, _, _) in self._slots.items():
            buffer = module._buffers.get(attr)
            if isinstance(buffer, torch.Tensor):
                now[name] = buffer.detach().clone()
        return now

    @torch.no_grad()
    def restore(self, values: dict[str, torch.Tensor] | None = None) -> None:
        """Put every buffer back as saved; `values`: these instead, for the names given."""
        values = values or {}
        for name, (module, attr, original, saved) in self._slots.items():
            value = values.get(name, saved)
            if value.shape != original.shape:  # a replacement of another shape
                module._buffers[attr] = value.clone()
                continue
            if module._buffers.get(attr) is not original:
                module._buffers[attr] = original
            original.copy_(value)


@contextlib.contextmanager
def updates_discarded(model: nn.Module) -> Iterator[None]:
    """Inside, every writable buffer of `model` is a copy; after, the originals are back,
    untouched. For a forward meshfit runs besides training (the pipeline cut's check
    forward, torch's stage metadata inference, which runs on empty tensors): a buffer
    the forward updates (a VQ-VAE's codebook averages, a step count) would otherwise
    start training with one update more, or with values from no batch at all (measured:
    a codebook under pp=2 with one micro-batch trained 1e-3 apart from one process).
    Swapped rather than copied back: the forward's graph, kept for a backward of its
    own, holds the copies, and an in-place write would break it. A buffer shared by
    two modules gets one copy."""
    slots = []
    copies: dict[int, torch.Tensor] = {}
    for _, module, name, buffer in _writable(model):
        if id(buffer) not in copies:
            copies[id(buffer)] = buffer.detach().clone()
        slots.append((module, name, buffer))
        module._buffers[name] = copies[id(buffer)]
    try:
        yield
    finally:
        for module, name, buffer in slots:
            module._buffers[name] = buffer
