"""A batch the model or the loss cannot take, said in one line.

On an engine's first training step (and its first evaluation) an exception from the
model, the loss or backward most often means the batch does not fit them: features of
another width, float targets for cross-entropy, a dict key the model's forward does not
know. torch says so deep inside a traceback; meshfit re-raises it as one MeshfitError
naming the batch's shapes and the original error (chained, so a plain Python run still
prints the traceback). Later steps let errors through untouched: by then the batch's
form has worked once, and an error is more likely the model's own bug, whose traceback
matters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshfit.errors import MeshfitError

# What a model or loss raises on input it cannot take. Not collectives' errors
# (DistBackendError, a RuntimeError): those are about peers, not the batch.
_INPUT_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError)


@contextlib.contextmanager
def explain_first_failure(first: bool, what: str, inputs: Any, targets: Any) -> Iterator[None]:
    """Inside, on the first call (`first`), turn an error of the model or loss into a
    MeshfitError that describes the batch; `what` names the call ("training step")."""
    if not first:
        yield
        return
    try:
        yield
    except MeshfitError:
        raise
    except _INPUT_ERRORS as exc:
        if isinstance(exc, getattr(dist, "DistBackendError", ())):
            raise
        raise MeshfitError(
            f"the first {what} failed inside the model or loss_fn on inputs "
            f"{describe(inputs)} and targets {describe(targets)}: {one_line(exc)}; give "
            f"batches the model and loss_fn take (shapes, dtypes, keys)"
        ) from exc


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` of an exception on one line, at most `limit` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_batch_explained(batches: Iterable[Any], what: str) -> Iterator[Any]:
    """The batches of a DataLoader; when its first batch cannot be made (samples of
    different shapes do not stack, samples that are not (inputs, targets)), one
    MeshfitError naming `what` (the dataset) says so."""
    iterator = iter(batches)
    try:
        first = next(iterator)
    except StopIteration:
        return
    except _INPUT_ERRORS as exc:
        raise MeshfitError(
            f"could not make a batch of {what}'s samples: {one_line(exc)}; give samples "
            f"of one shape, (inputs, targets) of tensors (pad sequences to one length)"
        ) from exc
    yield first
    yield from iterator


def describe(tree: Any, depth: int = 0) -> str:
    """A short description of a batch part: float32[4, 8], {'x': int64[4]}, (...)."""
    if isinstance(tree, torch.Tensor):
        return f"{str(tree.dtype).removeprefix('torch.')}{list(tree.shape)}"
    if depth >= 2:
        return "..."
    if isinstance(tree, Mapping):
        items = [f"{k!r}: {describe(v, depth + 1)}" for k, v in list(tree.items())[:4]]
        return "{" + ", ".join(items) + (", ...}" if len(tree) > 4 else "}")
    if isinstance(tree, (tuple, list)):
        items = [describe(v, depth + 1) for v in tree[:4]]
        return "(" + ", ".join(items) + (", ...)" if len(tree) > 4 else ")")
    return type(tree).__name__
