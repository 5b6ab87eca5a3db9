"""A batch the model or the loss cannot take, said in one line.

On an engine's first training step (and its first evaluation) an exception from the
model, the loss or backward most often means the batch does not fit them: features of
another width, float targets for cross-entropy, a dict key the model's forward does not
know. torch says so deep inside a traceback; meshfit re-raises it as one MeshfitError
naming the batch's shapes and the original error (chained, so a plain Python run still
prints the traceback). Later steps let errors through untouched: by then the batch's
form has worked once, and an error is more likely the model's own bug, whose traceback
matters.

Only an error whose innermost frame outside torch is the user's (the model's forward,
the loss, a metric, or meshfit's own line that calls one of them: a torch function
given as loss_fn) is about the batch. An error raised in meshfit's own code (a pipeline
stage sending what torch cannot send, say) is meshfit's: it goes through untouched,
traceback and all, with a note that says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
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
        where = meshfit_frame(exc.__traceback__)
        if where is not None:
            exc.add_note(
                f"meshfit: this error comes from meshfit's own code ({where}), not from your "
                f"model, loss or batch; please report it with this traceback"
            )
            raise
        raise MeshfitError(
            f"the first {what} failed inside the model or loss_fn on inputs "
            f"{describe(inputs)} and targets {describe(targets)}: {one_line(exc)}; give "
            f"batches the model and loss_fn take (shapes, dtypes, keys)"
        ) from exc


_TORCH = os.path.dirname(torch.__file__) + os.sep
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_MESHFIT = _PACKAGE + os.sep
# meshfit's functions that call the user's model, loss or metrics, or compute a user's
# layer (tensor parallel's forward of a split Linear): an error raised by a torch
# function they call directly (F.cross_entropy given as loss_fn, a product of the wrong
# width) is the user's.
_CALLS_USER_CODE = {"call_model", "call_forward", "forward_loss", "__call__", "forward"}


def meshfit_frame(tb: TracebackType | None) -> str | None:
    """ "file:line in function" of the innermost frame outside torch when it is meshfit's
    own code (not one of its calls of user code); None when it is the user's."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(_TORCH):
            continue
        if not filename.startswith(_MESHFIT) or frame.f_code.co_name in _CALLS_USER_CODE:
            return None
        return f"{os.path.relpath(filename, os.path.dirname(_PACKAGE))}:{frame.f_lineno} in {frame.f_code.co_name}"
    return None


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
