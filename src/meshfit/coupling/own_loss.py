"""A model's own loss formed over the global batch.

Hugging Face's object-detection loss (DETR, YOLOS, Conditional and Deformable DETR, the
rest of that family) matches each image's boxes to its queries and divides by the
batch's number of boxes and its class weights: over a rank's share of the batch it is
another number, and the ranks' mean is not the batch's loss (a tiny YOLOS's first batch
under dp=2: 1.4% apart). transformers' own DDP path (accelerate) sums the box count over
the ranks but leaves the class term a per-rank mean, so it trains another run as well.

When the coupling probe finds that a model's own loss couples the samples in its loss
function (every module's output per sample) and the model calls that loss through
transformers' `loss_function` attribute, meshfit learns how each argument of the call
holds the samples: the dimension that halves when the probe's samples do (the logits'
first, the decoder's stacked outputs' second), or a list of one item per sample (the
labels: one dict of boxes per image). It then wraps the loss function: in a step its
arguments are gathered from every rank of the batch (`scope.gather_rows`, the gradient
flowing back to the rank that holds each row; `scope.gather_items` for the labels), so
every rank computes the loss of the global batch as one process does, and the
gradients are exact as scope.py says. The probe checks the gathered loss passes before
anything trains; the loss function then runs on every rank over the whole batch (for a
detection loss: the matching, small beside the model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from meshfit.coupling.scope import current, gather_items, gather_rows

WHAT = "the model's own loss over the gathered batch"
ITEMS = "items"  # an argument that is a list of one item per sample

Layout = dict[Any, Any]  # argument (position or keyword) -> shape, or (ITEMS, length)


def loss_owner(model: nn.Module) -> nn.Module | None:
    """The outermost module that calls its loss through transformers' `loss_function`
    attribute (a property with a setter on PreTrainedModel) and has one: its class names
    a loss of transformers' table, or one was set. None otherwise (asking the property
    of a model without one logs transformers' warning that it falls back to the causal
    LM loss: Mask2Former computes its loss with its own criterion)."""
    for module in model.modules():
        if not isinstance(getattr(type(module), "loss_function", None), property):
            continue
        if "_loss_function" in vars(module):
            return module
        from transformers.loss.loss_utils import LOSS_MAPPING

        return module if getattr(module, "loss_type", None) in LOSS_MAPPING else None
    return None


class Recorder:
    """The loss function as it was, recording each call's arguments' layout."""

    def __init__(self, original: Callable) -> None:
        self.original = original
        self.calls: list[Layout] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(_layout(args, kwargs))
        return self.original(*args, **kwargs)


class GatheredLoss:
    """The loss function over the global batch while a step's scope asks for it (its
    `own_loss`: each argument's sample dimension); as it was anywhere else."""

    def __init__(self, original: Callable) -> None:
        self.original = original
        # Eager inside a compiled forward: the labels' gather sends Python objects, which
        # Dynamo cannot trace (it failed on the process group); a detection loss's
        # matching runs in scipy, outside any graph, all the same. (Made here, not at
        # import: torch.compiler.disable imports Dynamo, which `import meshfit` does not.)
        self._eager = torch.compiler.disable(self._call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._eager(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        scope = current()
        dims = scope.own_loss if scope is not None else None
        if not dims:
            return self.original(*args, **kwargs)
        args = tuple(_gathered(value, dims.get(i)) for i, value in enumerate(args))
        kwargs = {key: _gathered(value, dims.get(key)) for key, value in kwargs.items()}
        return self.original(*args, **kwargs)


@contextlib.contextmanager
def wrapped(owner: nn.Module, make: Callable[[Callable], Callable]) -> Iterator[Callable]:
    """`owner.loss_function` replaced by `make(it)` for a while, then as it was."""
    own = vars(owner)
    had, before = "_loss_function" in own, own.get("_loss_function")
    owner.loss_function = made = make(owner.loss_function)
    try:
        yield made
    finally:
        if had:
            owner.loss_function = before
        else:
            del owner._loss_function


def install(owner: nn.Module) -> None:
    """The loss function wrapped for good (a step's scope turns the gathering on)."""
    if not isinstance(owner.loss_function, GatheredLoss):
        owner.loss_function = GatheredLoss(owner.loss_function)


def sample_dims(whole: Layout, half: Layout, samples: int) -> dict[Any, Any] | None:
    """How each argument holds the samples, from its layout over `samples` samples and
    over half of them: the one dimension whose size halves with them, ITEMS for a list
    of one item per sample; arguments that do not change hold none. None when an
    argument changed otherwise (it cannot be gathered by rows)."""
    dims: dict[Any, Any] = {}
    rows = samples // 2
    for key, shape in whole.items():
        other = half.get(key)
        if other is None or len(other) != len(shape):
            return None
        if shape and shape[0] == ITEMS:
            if shape[1] == samples and other[1] == rows:
                dims[key] = ITEMS
            elif shape != other:
                return None
            continue
        changed = [d for d, (a, b) in enumerate(zip(shape, other, strict=True)) if a != b]
        if not changed:
            continue
        if len(changed) != 1 or shape[changed[0]] * rows != other[changed[0]] * samples:
            return None
        dims[key] = changed[0]
    return dims or None


def _layout(args: tuple, kwargs: dict) -> Layout:
    layout: Layout = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            layout[key] = tuple(value.shape)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(v, (Mapping, torch.Tensor)) for v in value)
        ):
            layout[key] = (ITEMS, len(value))
    return layout


def _gathered(value: Any, dim: Any) -> Any:
    if dim is None:
        return value
    if dim == ITEMS:
        return gather_items(value, WHAT)
    return gather_rows(value, dim, WHAT)
