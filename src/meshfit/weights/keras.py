"""Keras 3 models (torch backend) whose weights a form replaces: FSDP2 shards them.

A Keras layer computes with its variables' own tensors (`KerasVariable.value`, the
`torch.nn.Parameter` the variable made), while torch sees the same tensors registered in
each layer's `_torch_params` ParameterDict. FSDP2 replaces the registered parameters
(a shard between steps, the gathered whole during forward and backward), so a Keras
model went on computing with its original tensors and no gradient reached what the
optimizer steps (refused before the first update: batch_errors.py).

Keras has the hook for this itself: inside a `StatelessScope`, a variable's value is
whatever the scope returns for it (the mechanism of Keras's own stateless calls). During
the model's forward meshfit enters a scope whose values are looked up when a layer reads
them, from the module's parameter of that moment: FSDP2's gathered parameter in forward
(and, through autograd, its gradient in backward), the original one otherwise. Updates
a layer makes in the scope (a dropout seed's state) are assigned when it exits, as
outside a scope. Measured: the zoo's Keras MLP under fsdp=2 trains the one-process run
(tests/test_model_zoo.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

_INSTALLED = "_meshfit_reads_module_parameters"


def is_keras_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("keras") and hasattr(module, "variables")


def read_weights_from_modules(model: nn.Module) -> None:
    """Make each outermost Keras layer in `model` (the model itself, for a Keras model)
    read its variables from its modules' parameters during forward. Idempotent; nothing
    for a model without Keras layers."""
    outer = _outermost_keras_layers(model)
    for layer in outer:
        if getattr(layer, _INSTALLED, False):
            continue
        scopes: list[Any] = []
        layer.register_forward_pre_hook(lambda module, args, s=scopes: s.append(_enter(module)))
        layer.register_forward_hook(lambda module, args, out, s=scopes: _exit(s.pop()))
        object.__setattr__(layer, _INSTALLED, True)


def _outermost_keras_layers(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents before children
        if id(module) in inside or not is_keras_layer(module):
            continue
        found.append(module)
        inside.update(id(m) for m in module.modules())
    return found


def _registered(layer: nn.Module) -> dict[int, tuple[nn.ParameterDict, str]]:
    """Each variable of `layer` (by id) -> the ParameterDict and key it is registered
    under (a Keras layer registers its variables by path in `_torch_params`)."""
    where: dict[int, tuple[nn.ParameterDict, str]] = {}
    for module in layer.modules():
        params = module._modules.get("_torch_params")
        if params is None:
            continue
        for variable in getattr(module, "variables", []):
            if id(variable) not in where and variable.path in params._parameters:
                where[id(variable)] = (params, variable.path)
    return where


def _enter(layer: nn.Module) -> Any:
    from keras.src.backend.common.stateless_scope import StatelessScope

    class ModuleParameters(StatelessScope):
        """Variables read the parameter their module holds now; updates are kept."""

        def __init__(self, where: dict[int, tuple[nn.ParameterDict, str]]) -> None:
            super().__init__()
            self.where = where
            self.updated: list[tuple[Any, Any]] = []

        def add_update(self, update: tuple[Any, Any]) -> None:
            super().add_update(update)
            self.updated.append(update)

        def get_current_value(self, variable: Any) -> Any:
            if id(variable) in self.state_mapping:  # updated in this scope
                return self.state_mapping[id(variable)]
            registered = self.where.get(id(variable))
            if registered is None:
                return None
            params, key = registered
            return params._parameters[key]

    scope = ModuleParameters(_registered(layer))
    scope.__enter__()
    return scope


def _exit(scope: Any) -> None:
    scope.__exit__()
    for variable, value in scope.updated:  # as they would have been assigned in place
        variable.assign(value)
