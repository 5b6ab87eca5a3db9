"""What mf.verify and `meshfit verify` train: a target given as objects (model, loss,
options) or as a 'module:function' recipe each process calls itself.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.options import LossFn, check_option_names
from meshfit.verification.report import sgd_momentum

# ---- where the model comes from --------------------------------------------------


@dataclass(frozen=True)
class _Recipe:
    model: nn.Module
    loss_fn: LossFn | str
    options: dict[str, Any]  # mf.parallelize keywords, optimizer included


@dataclass(frozen=True)
class _Objects:
    """The model builder (or model), loss and options themselves, pickled to workers."""

    build: Callable[[], nn.Module] | nn.Module
    loss_fn: LossFn | str
    options: dict[str, Any]

    def recipe(self, seed: int) -> _Recipe:
        torch.manual_seed(seed)  # both runs start from the same weights
        if isinstance(self.build, nn.Module):
            model = copy.deepcopy(self.build)  # never train the caller's own model
        else:
            model = _check_model(self.build(), "build()")
        return _Recipe(model, self.loss_fn, self.options)


@dataclass(frozen=True)
class _Target:
    """`module:function` (meshfit verify): every process imports and calls it itself,
    so nothing of the user's needs to pickle (a lambda loss_fn is fine)."""

    target: str

    def call(self, seed: int) -> tuple[nn.Module, Any, LossFn | str, dict[str, Any]]:
        fn = load_target(self.target)
        torch.manual_seed(seed)  # both runs start from the same weights
        result = fn()
        what = f"{self.target}()"
        if not isinstance(result, tuple) or len(result) not in (3, 4):
            raise MeshfitError(
                f"{what} must return (model, batch, loss_fn) or (model, batch, loss_fn, "
                f"options), not {_describe(result)}"
            )
        built, batch, loss_fn, *rest = result
        options = rest[0] if rest else {}
        if not isinstance(options, Mapping):
            raise MeshfitError(
                f"the 4th item {what} returns is a dict of mf.parallelize options, not "
                f"{_describe(options)}"
            )
        _check_options(options, f"the options {what} returns hold")
        if callable(built) and not isinstance(built, nn.Module):
            built = _check_model(built(), f"the model builder {what} returned")
        model = _check_model(built, f"the first item {what} returns")
        return model, batch, loss_fn, dict(options)

    def recipe(self, seed: int) -> _Recipe:
        model, _, loss_fn, options = self.call(seed)
        return _Recipe(model, loss_fn, _with_default_optimizer(options))


def load_target(target: str) -> Callable[[], Any]:
    """The function `module:function` names, imported."""
    module_name, sep, name = target.partition(":")
    if not sep or not module_name or not name:
        raise MeshfitError(
            f"name the function as module:function, e.g. mypkg.train:build_model_and_batch, "
            f"not {target!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only when the target itself is missing; a missing import inside it is the
        # user's bug and keeps its traceback.
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise MeshfitError(
            f"cannot import {module_name!r} ({exc}); run from the directory that holds it "
            f"or add that directory to PYTHONPATH"
        ) from None
    fn = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise MeshfitError(f"{module_name!r} has no {name!r}")
    if not callable(fn):
        raise MeshfitError(f"{target} is not a function but {_describe(fn)}")
    return fn


def _check_model(model: Any, what: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise MeshfitError(f"{what} must be a torch.nn.Module, not {_describe(model)}")
    return model


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return type(value).__name__


def _with_default_optimizer(options: Mapping[str, Any]) -> dict[str, Any]:
    options = dict(options)
    if options.get("optimizer") is None:
        options["optimizer"] = sgd_momentum
    return options


def _check_options(options: Mapping[str, Any], what: str = "verify does not take") -> None:
    """Refuse a keyword mf.parallelize does not take (loss_fn is verify's own argument)."""
    check_option_names(options, what)
