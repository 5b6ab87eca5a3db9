"""A Hugging Face model's own initialisation as materialize.py replays it: its
_init_weights called module by module in construction order, and the initialisations its
layers run inline in their constructors (GPT-2's Conv1D).
"""

from __future__ import annotations

import sys

from torch import nn

from meshfit.weights.calls import Call, _post_order, _reset


def is_hugging_face(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def hugging_face_calls(model: nn.Module) -> list[Call]:
    """A Hugging Face model's initialisation in its constructors' order: building each
    module runs its reset_parameters; each PreTrainedModel's post_init then runs its
    `_init_weights` on its modules, children first, except those a sub-model's own
    post_init initialised already (the `_is_hf_initialized` flag); a sub-model is built
    (and initialised) where it is registered."""
    from transformers import PreTrainedModel

    calls: list[Call] = []
    nested: set[int] = set()
    built: set[int] = set()  # a module registered twice is built once

    def build(module: nn.Module) -> None:
        built.add(id(module))
        if module is not model and isinstance(module, PreTrainedModel):
            calls.extend(hugging_face_calls(module))
            nested.update(id(m) for m in module.modules())
            return
        for child in module.children():
            if id(child) not in built:
                build(child)
        calls.append(("reset_parameters", _reset, module))

    build(model)

    def hf_init(module: nn.Module) -> None:
        model._init_weights(module)

    hf_init.__name__ = f"{type(model).__name__}._init_weights"
    calls += [(hf_init.__name__, hf_init, m) for m in _post_order(model, skip=nested)]
    return calls
