"""The trained model as a plain file: safetensors that `safetensors.torch.load_file` and
`model.load_state_dict` take, gathered from any plan.

Two ways in: `engine.save_model(path)` from a live run (every rank calls it: the model
is gathered from its shards and stages, rank 0 writes), and `meshfit export CKPT OUT`
from a checkpoint directory alone, without the model's code (DCP's checkpoint read
through meshfit's safe reader, checksums verified). For a Hugging Face model,
`save_model` to a directory also writes its `config.json`, so the directory loads
with `from_pretrained`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from meshfit.errors import MeshfitError

WEIGHTS_FILE = "model.safetensors"  # the name from_pretrained looks for


def save_model(engine: Any, path: str) -> str | None:
    """Write `engine`'s whole model to `path` (a .safetensors file, or a directory that
    gets model.safetensors and, for a Hugging Face model, config.json). Call it on every
    rank; returns the weights file on rank 0, None elsewhere."""
    state = engine.full_state_dict()
    if engine.rank != 0:
        return None
    config = getattr(engine.user_model, "config", None)
    return write_safetensors(state, path, config=config)


def export_checkpoint(checkpoint_path: str, out: str) -> str:
    """Write the model weights of a meshfit checkpoint (a step directory, or a checkpoint
    root for its newest intact step) to `out` as safetensors. Needs no model code."""
    from meshfit.checkpoint import read_meta, resolve_checkpoint

    checkpoint = resolve_checkpoint(checkpoint_path)  # checksums verified
    meta = read_meta(checkpoint)
    state = _read_model_state(checkpoint)
    written = write_safetensors(state, out, config=None)
    print(f"meshfit: exported the step-{meta['step']} model of {checkpoint} to {written}")
    return written


def write_safetensors(state: dict[str, torch.Tensor], path: str, config: Any = None) -> str:
    """`state` as safetensors at `path` (a file ending in .safetensors, or a directory)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise MeshfitError(
            "writing safetensors needs the safetensors package: pip install safetensors "
            "(or meshfit[export])"
        ) from None
    if path.endswith(".safetensors"):
        file, directory = path, None
    else:
        directory = path
        file = os.path.join(path, WEIGHTS_FILE)
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    save_file(_separate(state), file, metadata={"format": "pt"})
    if directory is not None and hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(directory, "config.json"))
    return file


def _separate(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with its own memory: safetensors refuses tensors
    that share it (a tied embedding and LM head), while load_state_dict wants both
    names; the copy is taken only for the shared ones."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def _read_model_state(checkpoint: str) -> dict[str, torch.Tensor]:
    """The model part of a checkpoint, read from DCP's files as full tensors."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    from meshfit._safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    class _Planner(_EmptyStateDictLoadPlanner):
        """Builds the state dict from the checkpoint's own metadata (as torch's
        dcp_to_torch_save does), reading values as SafeLoadPlanner does."""

        load_bytes = SafeLoadPlanner.load_bytes

    state: dict[str, Any] = {}
    # The private loader torch's own dcp_to_torch_save calls (the public dcp.load fills
    # a copy of the dict, not this one), with the safe reader instead of plain pickle.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(
        state, storage_reader=SafeFileSystemReader(checkpoint), planner=_Planner(), no_dist=True
    )
    model = state.get("model")
    if isinstance(model, dict):
        return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    # a flat layout: "model.<name>" keys
    prefix = "model."
    found = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not found:
        raise MeshfitError(f"{checkpoint!r} holds no model weights under 'model'")
    return found
