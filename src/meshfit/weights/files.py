"""Pretrained weights in safetensors (`weights=`): the files, their names and shapes
checked against the model by name before training, and each tensor read by the slice
this rank keeps, into a model built on meta (materialize.py) or one built whole.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshfit.errors import MeshfitError
from meshfit.parallel.placements import chunk_by_chunk, local_part, local_window
from meshfit.state.state_hooks import OwnHooks
from meshfit.weights.calls import Slot, _key, _persistent, _table
from meshfit.weights.initializer import Initializer, _tensors_of


def load_weights(model: nn.Module, weights: WeightFiles, own_hooks: OwnHooks) -> None:
    """Load `weights` into a model that has its values (built on the CPU): every tensor
    the file holds, checked as for a meta model; unsaved buffers keep theirs. A model
    whose own hooks change the names it loads takes the files through them, as its
    load_state_dict would."""
    if own_hooks.loading:
        _load_through_hooks(model, weights)
        return
    tensors = _tensors_of(model, [])
    weights.check(tensors)
    for holders in tensors.groups:
        stored = weights.name_in_file(tensors, holders)
        if stored is not None:
            module, kind, name = holders[0]
            weights.read_into(stored, _table(module, kind)[name])


def _load_through_hooks(model: nn.Module, weights: WeightFiles) -> None:
    """model.load_state_dict of every tensor the files hold (the model's hooks rename
    and fuse them), with what does not fit said in one line."""
    state = weights.read_all()
    try:
        result = model.load_state_dict(state, strict=False)
    except (RuntimeError, KeyError) as error:  # shapes (one per line), or a hook's key
        first = str(error).strip().splitlines()[-1].strip()
        raise MeshfitError(
            f"weights={weights.path!r} does not fit this model: {first}; load weights of "
            f"this model's config"
        ) from None
    for what, keys in (("has no", result.missing_keys), ("holds", result.unexpected_keys)):
        if keys:
            raise MeshfitError(
                f"weights={weights.path!r} {what} {keys[0]!r}"
                + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")
                + (", which the model has" if what == "has no" else ", which it lacks")
                + "; load weights saved from this model (its state_dict names)"
            )


class WeightFiles:
    """Pretrained weights in safetensors: one file, or a directory holding
    model.safetensors or Hugging Face's shards with model.safetensors.index.json (what
    save_pretrained and meshfit export write). Each tensor is read by the slice a rank
    keeps (safe_open's get_slice), so no rank reads the whole model."""

    INDEX = "model.safetensors.index.json"

    def __init__(self, path: str) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise MeshfitError(
                "weights= reads safetensors: pip install safetensors (or meshfit[export])"
            ) from None
        self.path = path
        self._open = safe_open
        if os.path.isdir(path):
            index = os.path.join(path, self.INDEX)
            single = os.path.join(path, "model.safetensors")
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.isfile(single):
                self.files = dict.fromkeys(self._keys(single), single)
            else:
                raise MeshfitError(
                    f"weights={path!r} holds neither model.safetensors nor {self.INDEX}; "
                    f"give a .safetensors file or a directory save_pretrained wrote"
                )
        elif path.endswith(".safetensors") and os.path.isfile(path):
            self.files = dict.fromkeys(self._keys(path), path)
        else:
            raise MeshfitError(
                f"weights={path!r} is not a .safetensors file or a directory of them "
                f"(model.safetensors, or shards with {self.INDEX})"
            )
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def _keys(self, file: str) -> list[str]:
        with self._open(file, framework="pt") as f:
            return list(f.keys())

    def name_in_file(self, initializer: Initializer, holders: list[Slot]) -> str | None:
        """The name under which the file holds the tensor of `holders` (a tied weight
        under any of its names), or None."""
        return next(
            (n for slot in holders if (n := initializer.name_of(slot)) in self.shapes), None
        )

    def check(self, initializer: Initializer) -> None:
        """Refuse, naming it, a tensor of the model the file lacks (a buffer that is not
        saved is computed as usual), one the model lacks, or one of another shape."""
        known = set()
        for holders in initializer.groups:
            names = [initializer.name_of(slot) for slot in holders]
            known.update(names)
            stored = self.name_in_file(initializer, holders)
            if stored is None:
                if any(_persistent(slot) for slot in holders):
                    raise MeshfitError(
                        f"weights={self.path!r} has no {names[0]!r}, which the model has; "
                        f"load weights saved from this model (its state_dict names)"
                    )
                continue
            shape, _, _ = initializer.shapes[_key(holders[0])]
            if tuple(shape) != self.shapes[stored]:
                raise MeshfitError(
                    f"weights={self.path!r} holds {stored!r} of shape {self.shapes[stored]}, "
                    f"and the model's is {tuple(shape)}; load weights of this model's config"
                )
        unexpected = sorted(set(self.shapes) - known)
        if unexpected:
            raise MeshfitError(
                f"weights={self.path!r} holds {unexpected[0]!r}"
                + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                + ", which the model does not have; load weights saved from this model"
            )

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the files, whole (for a model that is whole anyway)."""
        state = {}
        for file in sorted(set(self.files.values())):
            with self._open(file, framework="pt") as f:
                state.update({name: f.get_tensor(name) for name in f.keys()})
        return state

    def read_into(self, name: str, current: torch.Tensor) -> None:
        """Copy this rank's part of tensor `name` into `current` (a DTensor: its local
        shard, read as a slice of the file)."""
        with self._open(self.files[name], framework="pt") as f, torch.no_grad():
            if isinstance(current, DTensor) and chunk_by_chunk(current):  # not one window
                current.to_local().copy_(local_part(current, f.get_tensor(name)))
            elif isinstance(current, DTensor):
                current.to_local().copy_(f.get_slice(name)[local_window(current)])
            else:
                current.copy_(f.get_tensor(name))
