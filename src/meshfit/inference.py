"""mf.predict: inference after training, as a user calls it.

    outputs = mf.predict(model, x, checkpoint="ckpt", plan="tp=2", batch_size=64)

The weights come from a fit checkpoint directory (its newest intact step), a step
directory (`ckpt/best` too), or safetensors from `engine.save_model` / `meshfit
export`; they are loaded into the whole model before the plan splits it, so any
checkpoint predicts under any plan and no optimizer state is read. The inputs (columns,
or a Dataset of input samples) are cut into global batches of `batch_size`, each run
through `engine.predict`, and the outputs joined in the inputs' order, in the model's
own form, on every rank. Every rank calls it, with the same inputs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from meshfit.errors import MeshfitError
from meshfit.trees import map_tensors, tensors_in

# parallelize's training options: refused rather than silently unused
_NOT_FOR_PREDICT = ("optimizer", "lr_scheduler", "grad_clip", "loss_fn", "metrics")


def predict(
    model: nn.Module | Any,
    inputs: Any,
    *,
    checkpoint: str | None = None,
    plan: Any = None,
    batch_size: int = 32,
    collate: Callable[[list[Any]], Any] | None = None,
    **parallelize_options: Any,
) -> Any:
    """The model's outputs on `inputs`, under `plan`, with the weights of `checkpoint`.

    model: the nn.Module (its architecture; the weights come from `checkpoint`, else
        it predicts with the weights it has), or a trained Engine (`history.engine`),
        used as it is (no plan, checkpoint or options then).
    inputs: what the model takes, one row per sample: a tensor, a numpy array or a
        list (floating point becomes torch's default dtype, as in fit), a dict of such
        columns (the model is called as model(**batch)), or a map-style Dataset of input
        samples, batched with `collate` (default: torch's default_collate).
    checkpoint: a fit checkpoint_dir (its newest intact step), one step directory (e.g.
        <checkpoint_dir>/best), a .safetensors file, or a directory holding
        model.safetensors or its shards with model.safetensors.index.json
        (engine.save_model's, save_pretrained's). Checksums are verified; a checkpoint
        of another model is refused, naming the keys that differ.
    plan: as in parallelize ("tp=2", a Plan, None = data parallel over every worker).
    batch_size: the GLOBAL batch of each forward (split over data-parallel ranks). The
        last, smaller batch is padded to split evenly and the padding's outputs dropped.
    Other keywords go to parallelize (tp_plan, pp_split, blocks, compile, ...).

    Returns the outputs of every sample in the inputs' order, in the model's own form
    (a tensor, a tuple, a dict, a Hugging Face ModelOutput) as CPU tensors, on every
    rank. Evaluation mode, no gradients.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise MeshfitError(f"batch_size must be a whole number >= 1, not {batch_size!r}")
    engine = _engine_for(model, inputs, checkpoint, plan, batch_size, collate, parallelize_options)
    unit = engine.topology.parts(engine.runner.eval_microbatches)
    parts = []
    for batch in _batches(inputs, batch_size, collate):
        size = tensors_in(batch)[0].shape[0]
        padded = -size % unit  # rows of padding for an even split (the last batch)
        if padded:
            batch = map_tensors(
                batch, lambda t, n=padded: torch.cat([t, t[-1:].expand(n, *t.shape[1:])])
            )
        outputs = engine.predict(batch)
        parts.append(_first_rows(outputs, size) if padded else outputs)
    if not parts:
        raise MeshfitError("predict's inputs hold no samples")
    return _joined(parts)


def _engine_for(
    model: Any,
    inputs: Any,
    checkpoint: str | None,
    plan: Any,
    batch_size: int,
    collate: Callable | None,
    options: dict[str, Any],
) -> Any:
    """The engine to predict with: the one given, or `model` with the checkpoint's
    weights, parallelized under `plan`."""
    from meshfit.engine import Engine

    if isinstance(model, Engine):
        if checkpoint is not None or plan is not None or options:
            raise MeshfitError(
                "mf.predict(engine, ...) predicts with that engine as it is; to load a "
                "checkpoint or choose a plan, pass the model: mf.predict(model, inputs, "
                "checkpoint=..., plan=...) (or engine.load(checkpoint) first)"
            )
        return model
    if not isinstance(model, nn.Module):
        raise MeshfitError(
            f"predict needs a torch.nn.Module or an Engine, not {type(model).__name__}"
        )
    refused = [name for name in _NOT_FOR_PREDICT if name in options]
    if refused:
        raise MeshfitError(
            f"mf.predict does not train: {', '.join(refused)} do(es) not apply; drop them"
        )
    if checkpoint is not None:
        load_weights(model, checkpoint)
    from meshfit.options import engine_options
    from meshfit.prepare import as_plan, auto_requested, prepare
    from meshfit.runtime.examples import Examples

    if isinstance(plan, str) and auto_requested(plan):
        raise MeshfitError(
            "mf.predict takes a plan, not 'auto': the planner chooses for training; pass "
            "the plan the training ran under (history.engine.plan), e.g. plan='tp=2'"
        )
    plan = as_plan(plan)  # under `meshfit run --plan auto`, None is dp over every worker
    engine_opts = engine_options("mf.predict does not take", _no_loss, options)

    def first(n: int) -> tuple[Any, None] | None:  # the forms' example: the first inputs
        batch = next(_batches(inputs, n, collate), None)
        return None if batch is None else (batch, None)

    return prepare(model, plan, engine_opts, Examples(first, batch_size)).engine(model)


def _no_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """parallelize wants a loss; prediction never computes one (under pp the schedule
    calls it with a stand-in target that engine.predict tells it to skip)."""
    raise MeshfitError("an engine made by mf.predict cannot train")


def load_weights(model: nn.Module, checkpoint: str) -> None:
    """The whole model's weights from `checkpoint` (see predict) into `model`."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise MeshfitError(f"checkpoint must be a path, not {checkpoint!r}")
    checkpoint = os.fspath(checkpoint)
    from meshfit.state.export import WEIGHTS_FILE
    from meshfit.state.state_hooks import OwnHooks

    weights = os.path.join(checkpoint, WEIGHTS_FILE)
    shards = os.path.join(checkpoint, "model.safetensors.index.json")
    hooks = OwnHooks.of(model)
    if os.path.isfile(shards):  # save_model's shards
        from meshfit.weights.files import WeightFiles

        state = WeightFiles(checkpoint).read_all()
        aside = contextlib.nullcontext()
    elif checkpoint.endswith(".safetensors") or os.path.isfile(weights):
        state = _read_safetensors(checkpoint if checkpoint.endswith(".safetensors") else weights)
        aside = contextlib.nullcontext()  # save_model's names: the model's own hooks apply
    else:
        from meshfit.state.checkpoint import resolve_checkpoint
        from meshfit.state.export import _read_model_state

        state = _read_model_state(resolve_checkpoint(checkpoint))  # checksums verified
        aside = hooks.set_aside()  # a checkpoint holds the modules' own names
    with aside:
        _load_checked(model, state, checkpoint)


def _load_checked(model: nn.Module, state: dict[str, torch.Tensor], checkpoint: str) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or wrong:
        raise MeshfitError(
            f"checkpoint {checkpoint!r} does not fit this model: "
            + "; ".join(
                f"{what} {_some(keys)}"
                for what, keys in (
                    ("missing", missing),
                    ("not in the model", unexpected),
                    ("of another shape", wrong),
                )
                if keys
            )
            + ". Build the model the checkpoint was saved from"
        )
    model.load_state_dict(state)


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise MeshfitError(f"no weights at {path!r}: the file does not exist")
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise MeshfitError(
            "reading safetensors needs the safetensors package: pip install safetensors "
            "(or meshfit[export])"
        ) from None
    return load_file(path)


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _batches(inputs: Any, batch_size: int, collate: Callable | None) -> Iterator[Any]:
    """Global batches of `inputs` in order: columns are sliced, a Dataset is read with a
    DataLoader (no shuffling, the last batch kept)."""
    if isinstance(inputs, IterableDataset):
        raise MeshfitError(
            "mf.predict takes a map-style Dataset or columns, not a stream (IterableDataset): "
            "run engine.predict on each batch you read from it"
        )
    if isinstance(inputs, Dataset):
        yield from DataLoader(inputs, batch_size=batch_size, collate_fn=collate or default_collate)
        return
    from meshfit.data.columns import _columns, _rows

    if collate is not None:
        raise MeshfitError(
            "collate applies to a Dataset of samples; columns are sliced as they are"
        )
    if not isinstance(inputs, (torch.Tensor, Mapping, list, tuple)) and not hasattr(
        inputs, "__array__"
    ):
        raise MeshfitError(
            f"predict's inputs must be a tensor, an array, a list, a dict of columns or a "
            f"Dataset, not {type(inputs).__name__}"
        )
    columns = _columns(inputs, "inputs")
    rows = _rows(columns, "inputs")
    for start in range(0, rows, batch_size):
        yield map_tensors(columns, lambda t, s=start: t[s : s + batch_size])


def _first_rows(outputs: Any, size: int) -> Any:
    """`outputs` without the padding's rows (batch-first tensors cut to `size`)."""
    leaves, spec = tree_flatten(outputs)
    kept = [t[:size] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in leaves]
    return tree_unflatten(kept, spec)


def _joined(parts: list[Any]) -> Any:
    """The batches' outputs as one, batch-first tensors concatenated (as engine.predict
    joins the data-parallel shares); other leaves from the first batch."""
    if len(parts) == 1:
        return parts[0]
    flat = [tree_flatten(p) for p in parts]
    spec = flat[0][1]
    joined = [
        torch.cat(leaves)
        if isinstance(leaves[0], torch.Tensor) and leaves[0].dim() > 0
        else leaves[0]
        for leaves in zip(*(f for f, _ in flat), strict=True)
    ]
    return tree_unflatten(joined, spec)
