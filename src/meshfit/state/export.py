"""The trained model as plain files: safetensors that `safetensors.torch.load_file` and
`model.load_state_dict` take, gathered from any plan.

Two ways in: `engine.save_model(path)` from a live run, and `meshfit export CKPT OUT`
from a checkpoint directory alone, without the model's code (DCP's checkpoint read
through meshfit's safe reader, checksums verified). For a Hugging Face model,
`save_model` to a directory also writes its `config.json`, so the directory loads
with `from_pretrained`.

`save_model` streams: every rank calls it, and tensor by tensor the ranks that hold one
gather it (a shard's FSDP2 / tensor-parallel DTensor: its full tensor; a stage's: its
owner sends it to rank 0), rank 0 writes a file whenever it holds `max_shard_size` of
them, Hugging Face's way (`model-00001-of-00003.safetensors` and
`model.safetensors.index.json`; a model that fits one file is `model.safetensors`). So
no process holds more than one file's worth of gathered tensors (and one tensor), and
the directory loads back with `from_pretrained` or `weights=`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from meshfit.errors import MeshfitError
from meshfit.parallel.placements import full_tensor

if TYPE_CHECKING:
    from torch import nn

    from meshfit.runtime.runners import Runner
    from meshfit.state.state_hooks import OwnHooks


@dataclass(frozen=True)
class ModelState:
    """What export reads of a live run: the model as the forms made it, the runner that
    knows which stage owns what, the model's own state-dict hooks, the device, whether
    the run is distributed, and the model's config (a Hugging Face model's, written as
    config.json beside the weights)."""

    module: nn.Module
    runner: Runner
    own_hooks: OwnHooks
    device: torch.device
    distributed: bool
    config: Any = None


WEIGHTS_FILE = "model.safetensors"  # the name from_pretrained looks for


def save_model(model: ModelState, path: str, max_shard_size: int | str = "5GB") -> str | None:
    """Write the whole model (`model`: what the forms made of it) to `path`: a directory
    that gets model.safetensors, or
    shards of at most `max_shard_size` (bytes, or "500MB", "5GB") with their index, and
    for a Hugging Face model config.json; or one .safetensors file (rank 0 then holds the
    whole model). Call it on every rank; returns the weights file (the index, for
    shards) on rank 0, None elsewhere."""
    import torch.distributed as dist

    limit = _size(max_shard_size)
    single = path.endswith(".safetensors")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    hooks = model.own_hooks
    with hooks.set_aside():  # the modules' own names; their saving hooks run per file
        local = _sharded_state(model)
    entries = _entries(local, distributed)
    shards = [entries] if single else _shards(entries, limit, hooks.unit_of)
    directory = None if single else path
    if rank == 0:
        os.makedirs(directory or os.path.dirname(os.path.abspath(path)), exist_ok=True)
    names = _file_names(path, len(shards), single)
    weight_map: dict[str, str] = {}
    for file, shard in zip(names, shards, strict=True):
        tensors = {}
        for entry in shard:
            value = _gathered(entry, local, model.device, rank)
            if rank == 0:
                tensors[entry.key] = value
        if rank == 0:
            if hooks.saving:  # as model.state_dict() names them (state_hooks.py)
                units = {hooks.unit_of(k) for k in tensors} - {None}
                tensors = hooks.run_saving_hooks(tensors, sorted(units))
            weight_map.update(dict.fromkeys(tensors, os.path.basename(file)))
            _write_file(tensors, file)
    if rank != 0:
        return None
    config = model.config
    if directory is not None and hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(directory, "config.json"))
    if len(names) == 1:
        return names[0]
    return _write_index(path, entries, weight_map)


@dataclass(frozen=True)
class _Entry:
    """One tensor of the model's state: its name, full shape and dtype, which ranks hold
    (a part of) it, and the one that sends it to rank 0."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    holders: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _sharded_state(model: ModelState) -> dict[str, torch.Tensor]:
    """This rank's state as it holds it (DTensors for shards), under the model's own
    names, less what another pipeline stage owns."""
    if not model.distributed:
        return dict(model.module.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return model.runner.owned_state(get_model_state_dict(model.module))


def _entries(local: dict[str, torch.Tensor], distributed: bool) -> list[_Entry]:
    """Every rank's tensors, in one order everywhere (rank by rank, each in its state's
    order: the model's, stage after stage)."""
    import torch.distributed as dist

    mine = [(k, tuple(v.shape), v.dtype) for k, v in local.items()]
    everyone = [mine]
    if distributed:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    found: dict[str, tuple[tuple[int, ...], torch.dtype, list[int]]] = {}
    for rank, items in enumerate(everyone):
        for key, shape, dtype in items:
            found.setdefault(key, (shape, dtype, []))[2].append(rank)
    return [_Entry(k, shape, dtype, tuple(r)) for k, (shape, dtype, r) in found.items()]


def _shards(
    entries: list[_Entry], limit: int, unit_of: Callable[[str], str | None] = lambda key: None
) -> list[list[_Entry]]:
    """The entries cut into files of at most `limit` bytes (a larger tensor alone), never
    between two tensors of one unit (`unit_of(key)`, None for none: a module whose own
    saving hooks need all its tensors at once)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        unit = unit_of(entry.key)
        same_unit = bool(shards[-1]) and unit is not None and unit_of(shards[-1][-1].key) == unit
        if shards[-1] and size + entry.nbytes > limit and not same_unit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _gathered(
    entry: _Entry, local: dict[str, torch.Tensor], device: torch.device, rank: int
) -> torch.Tensor | None:
    """The full tensor of `entry` on rank 0 (None elsewhere): the ranks holding it
    gather a sharded one together; its first holder sends it when rank 0 holds none."""
    import torch.distributed as dist

    value = None
    if entry.key in local:
        value = local[entry.key]
        if isinstance(value, DTensor):
            value = full_tensor(value)  # collective over the ranks that hold its shards
        value = value.detach()
    if 0 in entry.holders:
        return value.cpu() if rank == 0 else None
    sender = entry.holders[0]
    if rank == sender:
        dist.send(value.contiguous().to(device), dst=0)
    elif rank == 0:
        received = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        dist.recv(received, src=sender)
        return received.cpu()
    return None


def _size(limit: int | str) -> int:
    """Bytes of "500MB", "5GB", "20KB" (powers of 1000, as Hugging Face's) or an int."""
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    if isinstance(limit, str):
        text = limit.strip().upper()
        for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
            if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
                return int(float(text[: -len(unit)]) * factor)
    raise MeshfitError(f"max_shard_size must be bytes or text such as '5GB', not {limit!r}")


def _write_file(tensors: dict[str, torch.Tensor], file: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise MeshfitError(
            "writing safetensors needs the safetensors package: pip install safetensors "
            "(or meshfit[export])"
        ) from None
    save_file(_separate(tensors), file, metadata={"format": "pt"})


def export_checkpoint(checkpoint_path: str, out: str, max_shard_size: int | str = "5GB") -> str:
    """Write the model weights of a meshfit checkpoint (a step directory, or a checkpoint
    root for its newest intact step) to `out` as safetensors; needs no model code. `out`
    is a directory (model.safetensors, or Hugging Face-style shards of at most
    `max_shard_size` with their index) or one .safetensors file. Streamed: the tensors of
    one file at a time are read from the checkpoint (DCP reads only those), written and
    freed, so the process never holds more than one file's worth of the model (a single
    .safetensors file holds all of it). Returns the weights file (the index, for shards)."""
    from meshfit.state.checkpoint import read_meta, resolve_checkpoint

    limit = _size(max_shard_size)
    checkpoint = resolve_checkpoint(checkpoint_path)  # checksums verified
    meta = read_meta(checkpoint)
    entries = _checkpoint_entries(checkpoint)
    single = out.endswith(".safetensors")
    shards = [entries] if single else _shards(entries, limit)
    names = _file_names(out, len(shards), single)
    os.makedirs(os.path.dirname(os.path.abspath(names[0])), exist_ok=True)
    weight_map: dict[str, str] = {}
    for file, shard in zip(names, shards, strict=True):
        tensors = _read_model_tensors(checkpoint, shard)
        _write_file(tensors, file)
        weight_map.update(dict.fromkeys(tensors, os.path.basename(file)))
        del tensors
    written = names[0] if len(names) == 1 else _write_index(out, entries, weight_map)
    print(f"meshfit: exported the step-{meta['step']} model of {checkpoint} to {written}")
    return written


def _file_names(path: str, count: int, single: bool) -> list[str]:
    """The weights files of a model cut into `count` files, Hugging Face's names."""
    if single:
        return [path]
    if count == 1:
        return [os.path.join(path, WEIGHTS_FILE)]
    return [
        os.path.join(path, f"model-{i + 1:05d}-of-{count:05d}.safetensors") for i in range(count)
    ]


def _write_index(directory: str, entries: list[_Entry], weight_map: dict[str, str]) -> str:
    index = os.path.join(directory, "model.safetensors.index.json")
    total = sum(e.nbytes for e in entries)
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return index


def _checkpoint_entries(checkpoint: str) -> list[_Entry]:
    """The model's tensors a checkpoint holds (names, full shapes, dtypes), from DCP's
    metadata alone, in the order they were saved."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from meshfit.state.safe_dcp import SafeFileSystemReader

    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    prefix = "model."
    entries = [
        _Entry(key[len(prefix) :], tuple(item.size), item.properties.dtype, ())
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    ]
    if not entries:
        raise MeshfitError(f"{checkpoint!r} holds no model weights under 'model'")
    return entries


def _read_model_tensors(checkpoint: str, entries: list[_Entry]) -> dict[str, torch.Tensor]:
    """The full tensors of `entries`, read from the checkpoint (only those)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from meshfit.state.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    model = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in entries}
    # DCP's loader filling this dict in place (dcp.load fills a copy), with the safe reader
    _load_state_dict(
        {"model": model},
        storage_reader=SafeFileSystemReader(checkpoint),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    return model


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

    from meshfit.state.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

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
