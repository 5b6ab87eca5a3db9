"""ModelValues: where a model's values come from, and the three moments the forms give
them (parallel/compose.py makes one and its forms call it; nothing else touches the
model's values).

- before any form: a model built with values takes pretrained safetensors whole
  (`weights=`; its own load hooks run) and, in a job of several workers, rank 0's values
  where the workers built others (same_start.py);
- a model built on meta records its initialisation once fp8 has swapped its Linears
  (initializer.py), and is given storage and values when the data-parallel form has
  sharded it (FSDP2: each rank its shard from the start) or before DDP (which
  broadcasts real values): materialize.py, from the model's own initialisation or from
  the safetensors, each rank reading only its slices (files.py);
- after every form: a meshfit checkpoint given as `weights=` is read by DCP into the
  split model, each rank its pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.state.state_hooks import OwnHooks
from meshfit.weights.initializer import Initializer, on_meta, plan_initialization

if TYPE_CHECKING:
    from meshfit.weights.files import WeightFiles


@dataclass
class ModelValues:
    """The values of one engine's model: built on meta or not, `weights=` as safetensors
    (`files`) or as a meshfit checkpoint (`checkpoint`, with the model's fingerprint to
    check it against), `init` for a meta model's initialisation passes."""

    meta: bool
    own_hooks: OwnHooks
    init: Any = None
    files: WeightFiles | None = None
    checkpoint: str | None = None
    fingerprint: Any = None
    initializer: Initializer | None = None
    model: nn.Module | None = None  # the meta model as it was recorded (forms change it in place)

    @classmethod
    def of(
        cls, model: nn.Module, own_hooks: OwnHooks, init: Any, weights: str | None
    ) -> ModelValues:
        """What the values of `model` come from (nothing read yet). A safetensors file
        cannot be read slice by slice into a meta model whose own load hooks rename what
        they load: refused here, before any form."""
        # DTensor (which files.py's slicing reads) pulls in sympy: imported where used,
        # so that `import meshfit` stays cheap (tests/test_import.py)
        from meshfit.state.checkpoint import holds_checkpoint, model_fingerprint
        from meshfit.weights.files import WeightFiles

        meta = on_meta(model)
        checkpoint = weights if weights is not None and holds_checkpoint(weights) else None
        files = WeightFiles(weights) if weights is not None and checkpoint is None else None
        if files is not None and meta and own_hooks.loading:
            raise MeshfitError(
                f"weights= cannot be read slice by slice into this model built on meta: "
                f"{own_hooks.loading[0] or type(model).__name__} changes the names it loads "
                f"in its own load_state_dict hooks; build the model on the CPU (weights= "
                f"then loads through those hooks), or load a meshfit checkpoint"
            )
        fingerprint = model_fingerprint(model) if checkpoint is not None else None
        return cls(meta, own_hooks, init, files, checkpoint, fingerprint)

    def before_forms(self, model: nn.Module, distributed: bool, placed: bool) -> None:
        """A model with values: the safetensors whole, then rank 0's values on every rank
        where the workers built others (no seed before the build)."""
        if self.meta:
            return
        if self.files is not None:
            from meshfit.weights.files import load_weights

            load_weights(model, self.files, self.own_hooks)
        if distributed and not placed:
            from meshfit.weights.same_start import start_from_rank0

            start_from_rank0(model)

    def record_initialization(self, model: nn.Module) -> None:
        """A meta model's initialisation, as its calls and what each writes: after fp8's
        swap of Linears, before any parallel form changes the model."""
        if self.meta:
            self.initializer = plan_initialization(model, self.init)
            self.model = model

    def materialize(self, device: torch.device) -> None:
        """Storage and values for what this rank keeps of a meta model, as the forms have
        split, sharded and pruned it in place (a no-op for one built with values)."""
        if self.initializer is None or self.model is None:
            return
        from meshfit.weights.materialize import materialize

        materialize(self.initializer, self.model, device, self.files)

    def describe(self) -> str | None:
        """The start-up line of what `weights=` read (None without it): a planted change
        to a head was the only way to tell the weights had been read."""
        if self.checkpoint is not None:
            return (
                f"weights: the model values of the meshfit checkpoint {self.checkpoint}, "
                f"read by DCP (each rank its pieces)"
            )
        if self.files is None:
            return None
        values = sum(math.prod(shape) for shape in self.files.shapes.values())
        files = len(set(self.files.files.values()))
        how = (
            "each rank read only the slices it keeps (the model was built on meta)"
            if self.meta
            else "read whole into each rank's model before the plan split it"
        )
        return (
            f"weights: {len(self.files.shapes)} tensors ({values / 1e6:,.1f}M values) from "
            f"{self.files.path} ({files} file{'s' if files != 1 else ''}); {how}"
        )

    def after_forms(self, parallel_model: nn.Module, strided: bool) -> None:
        """A meshfit checkpoint as weights: its model values read by DCP into the split
        model (`strided`: tensor parallel's chunked shards are re-laid out)."""
        if self.checkpoint is None:
            return
        from meshfit.state.checkpoint import load_model_weights

        with self.own_hooks.set_aside():  # a checkpoint holds the modules' own names
            load_model_weights(parallel_model, self.checkpoint, self.fingerprint, strided=strided)
