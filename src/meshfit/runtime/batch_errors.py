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
traceback and all, with a note that says so. So does a collective that failed because a
peer process went away (gloo raises a plain RuntimeError, "Connection closed by peer",
from inside the model's forward when a peer was killed by the out-of-memory killer).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from meshfit.coupling import halves
from meshfit.errors import MeshfitError
from meshfit.launch.elastic import peer_failure_word
from meshfit.trees import tensors_in

# What a model or loss raises on input it cannot take. Not collectives' errors
# (DistBackendError, a RuntimeError): those are about peers, not the batch.
_INPUT_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError)


def collective_failed(exc: BaseException) -> bool:
    """Whether `exc` is a collective's own error (torch's DistBackendError, a
    RuntimeError): about the peers, never the batch's or the model's; re-raised as it is."""
    return isinstance(exc, getattr(dist, "DistBackendError", ()))


@contextlib.contextmanager
def explain_first_failure(
    first: bool, what: str, inputs: Any, targets: Any, model_dtype: torch.dtype | None = None
) -> Iterator[None]:
    """Inside, on the first call (`first`), turn an error of the model or loss into a
    MeshfitError that describes the batch; `what` names the call ("training step").
    Where the error names a dtype, the model's own (`model_dtype`) is said beside the
    batch's: a kernel that refuses the model's dtype (Qwen2-MoE's grouped matmul in
    float64) is no batch problem."""
    if not first:
        yield
        return
    try:
        yield
    except MeshfitError:
        raise
    except _INPUT_ERRORS as exc:
        if collective_failed(exc):
            raise
        lost = peer_failure_word(exc)
        if lost is not None:  # gloo raises a plain RuntimeError when a peer is gone
            exc.add_note(
                f"meshfit: a peer process went away during a collective ({lost}): not a "
                f"problem of this batch; the peer's own output says why (the kernel's "
                f"out-of-memory killer, a crash, a lost host)"
            )
            raise
        where = meshfit_frame(exc.__traceback__)
        if where is not None:
            exc.add_note(
                f"meshfit: this error comes from meshfit's own code ({where}), not from your "
                f"model, loss or batch; please report it with this traceback"
            )
            raise
        fix = "give batches the model and loss_fn take (shapes, dtypes, keys)"
        model = ""
        if model_dtype is not None and _DTYPE_WORDS.search(str(exc)):
            name = str(model_dtype).removeprefix("torch.")
            model = f" (the model's parameters in {name})"
            fix += f", or build the model in a dtype its layers take, if one refuses {name}"
        raise MeshfitError(
            f"the first {what} failed inside the model or loss_fn on inputs "
            f"{describe(inputs)} and targets {describe(targets)}{model}: {one_line(exc)}; "
            f"{fix}"
        ) from exc


# An error naming a dtype: PyTorch's kernels say "Double", "Float", "BFloat16", ...
_DTYPE_WORDS = re.compile(
    r"\b(Double|Float|Half|BFloat16|float64|float32|float16|bfloat16|dtype)\b"
)


_TORCH = os.path.dirname(torch.__file__) + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # meshfit (this: runtime/)
_MESHFIT = _PACKAGE + os.sep
# meshfit's functions that call the user's model, loss or metrics, or compute a user's
# layer (tensor parallel's forward of a split Linear): an error raised by a torch
# function they call directly (F.cross_entropy given as loss_fn, a product of the wrong
# width) is the user's.
_CALLS_USER_CODE = {"call_model", "call_forward", "forward_loss", "__call__", "forward"}
# ... except these, by qualified name: meshfit's own computations named like them (the
# chunked loss's autograd Function: a head weight freed under pp x fsdp read as the
# user's batch being wrong).
_OWN_COMPUTATIONS = {"_LinearCrossEntropy.forward", "_LinearCrossEntropy.backward"}
# Files whose frames only pass a call on: torch's deprecation decorator wraps collectives
# (all_gather_into_tensor) in typing_extensions' wrapper, which sat between a collective
# meshfit called and its error, and the error read as the user's batch.
_PASS_THROUGH = {"typing_extensions.py", "functools.py", "contextlib.py"}


def meshfit_frame(tb: TracebackType | None) -> str | None:
    """ "file:line in function" of the innermost frame outside torch when it is meshfit's
    own code (not one of its calls of user code); None when it is the user's."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        filename = os.path.abspath(frame.f_code.co_filename)
        if (
            filename.startswith(_TORCH)
            or frame.f_code.co_name == "__torch_function__"
            or os.path.basename(filename) in _PASS_THROUGH
        ):
            continue  # torch, a mode of meshfit's that passes the call on, a decorator's wrapper
        own = frame.f_code.co_qualname in _OWN_COMPUTATIONS
        if not filename.startswith(_MESHFIT) or (
            frame.f_code.co_name in _CALLS_USER_CODE and not own
        ):
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


def check_gradients_reached_the_optimizer(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    plan: Any,
    model_class: str,
    rank: int,
    under_ddp: bool = False,
) -> list[str]:
    """After the first backward, before the first update: the parameters the optimizer
    steps must be the ones the model computed with. A model whose layers keep their own
    references to their weights (Keras layers do) computes with the originals after
    FSDP2 or DTensor replaced them, and its optimizer would step parameters no loss
    reaches: measured, a Keras model under fsdp=2 trained another run with no error.
    Returns the names of the parameters that got no gradient `under_ddp` (the engine
    turns DDP's search for unused parameters on and runs the step again); else warns."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    missing = [p for p in params if p.grad is None]
    if not params or not missing:
        return []
    from torch.nn.parallel import DistributedDataParallel

    named = model.module if isinstance(model, DistributedDataParallel) else model  # "module."
    names = {id(p): n for n, p in named.named_parameters()}
    if len(missing) == len(params):
        optimizer.zero_grad(set_to_none=True)
        raise MeshfitError(
            f"the first training step gave none of the {len(params)} parameters under "
            f"plan {plan} a gradient: {model_class} computes "
            f"with other tensors than the ones the plan put in its modules (its layers "
            f"keep their own references to their weights, which "
            f"{'FSDP2' if plan.uses_fsdp else 'the plan'} replaces). Use a plan "
            f"that keeps the parameters in place (dp), or a model whose layers read "
            f"their weights from the module"
        )
    if under_ddp:
        return [names.get(id(p), "?") for p in missing]
    listed = ", ".join(names.get(id(p), "?") for p in missing[:5])
    listed += ", ..." if len(missing) > 5 else ""
    if rank == 0:
        warnings.warn(
            f"{len(missing)} of {len(params)} trainable parameters got no gradient in "
            f"the first training step ({listed}): "
            f"unused by this loss, or computed around the plan's parameters. If they get "
            f"one in a single process, the plan lost them: check with mf.verify",
            stacklevel=5,
        )
    return []


def warn_on_ignored_targets(targets: Any, topology: Any) -> None:
    """A mean loss over targets with ignored entries (-100, or the pad id a script's
    labels are padded with and its loss given as ignore_index) weighs tokens unequally
    once the batch is split into ranks or micro-batches: say so once, with the fix.
    Called where the coupling probe told no mean over the real targets (nor a plain one
    over uneven counts)."""
    if topology.batch_parts == 1:
        return
    split = (
        f"the batch is split over {topology.dp_size} rank(s) x "
        f"{topology.plan.num_microbatches} micro-batch(es)"
    )
    if any(
        not t.is_floating_point() and bool((t == halves.IGNORED).any()) for t in tensors_in(targets)
    ):
        ignored, held = halves.IGNORED, f"the targets hold {halves.IGNORED} (ignored) entries"
    elif (padding := halves.clearly_padded(targets)) is not None:
        # a pad-id mean the probe could not tell from a plain one (a model near uniform)
        ignored, held = padding, f"the targets' rows are padded with {padding}"
    else:
        return
    warnings.warn(
        f"{held} and {split}: a loss_fn that returns a mean over the targets that are not "
        f"{ignored} weighs the real tokens of each part by that part's count, not the "
        "global one, so the run differs from one process. Return a pair (loss_sum, count) "
        f"instead, e.g. loss_fn=mf.losses.cross_entropy(ignore_index={ignored})",
        stacklevel=5,
    )
