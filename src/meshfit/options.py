"""EngineOptions: everything `parallelize` takes besides the model and the plan, checked
once, where they are made.

`parallelize` lists the options in its signature (its docstring says what each does);
`fit` and `predict` turn their extra keywords into one EngineOptions (`engine_options`)
and hand it to `prepare`; `verify` checks them here and passes them to each run's
`parallelize`. An option of the
wrong kind is refused here, in one line naming the fix, before any process group starts.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.metrics import check_metrics

if TYPE_CHECKING:
    from meshfit.parallel.tensor import TPPlan

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
LossFn = Callable[[Any, Any], torch.Tensor]
InitFn = Callable[[nn.Module], None] | Sequence[Callable[[nn.Module], None]]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW(lr=3e-4): what meshfit uses when no optimizer is given; the fused CUDA
    kernel when every parameter is on a GPU (one launch per step instead of several per
    tensor)."""
    params = list(params)
    on_gpu = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=3e-4, fused=on_gpu or None)


@dataclass(frozen=True)
class EngineOptions:
    """`parallelize`'s options, checked (see its docstring for each). `optimizer=None`
    becomes `default_optimizer`, `weights=None` `meshfit run --weights`'s path."""

    loss_fn: LossFn | str | None  # a function, or "model" for the model's own loss
    optimizer: OptimizerFactory | None = None
    grad_clip: float | None = None
    lr_scheduler: SchedulerFactory | None = None
    compile: bool = False
    tp_plan: TPPlan | None = None
    pp_split: list[int] | None = None
    example_inputs: Any = None
    sync_batchnorm: bool = True
    blocks: str | None = None
    metrics: dict[str, Any] | None = None
    init: InitFn | None = None  # for a model on meta: materialize.py's init passes
    weights: str | os.PathLike | None = None  # pretrained safetensors (weight_files.WeightFiles)
    chunked_loss: bool | int = False  # the LM head and loss a chunk of tokens at a time
    fp8_recipe: str = "tensorwise"  # precision="fp8": how float8 scales are taken
    fp8_head: bool = False  # precision="fp8": the output layer in float8 too

    def __post_init__(self) -> None:
        _check_loss(self.loss_fn)
        _check_optimizer(self.optimizer)
        if self.grad_clip is not None and not (
            isinstance(self.grad_clip, numbers.Real)
            and not isinstance(self.grad_clip, bool)
            and self.grad_clip > 0
        ):
            raise MeshfitError(f"grad_clip must be a positive number, not {self.grad_clip!r}")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise MeshfitError(
                f"lr_scheduler must be a function of the optimizer, e.g. lambda optimizer: "
                f"torch.optim.lr_scheduler.StepLR(optimizer, 100), not {self.lr_scheduler!r}"
            )
        for name in ("compile", "sync_batchnorm", "fp8_head"):
            if not isinstance(getattr(self, name), bool):
                raise MeshfitError(f"{name} must be True or False, not {getattr(self, name)!r}")
        chunked = self.chunked_loss
        if not isinstance(chunked, bool) and not (isinstance(chunked, int) and chunked > 0):
            raise MeshfitError(
                f"chunked_loss must be True, False or a number of tokens per chunk, not {chunked!r}"
            )
        _check_fp8(self.fp8_recipe, self.fp8_head, chunked)
        if self.blocks is not None and not isinstance(self.blocks, str):
            raise MeshfitError(
                f"blocks must be the name of the container of the model's blocks, e.g. "
                f"'model.layers', not {self.blocks!r}"
            )
        # frozen: the normalised values are set once, here
        object.__setattr__(self, "optimizer", self.optimizer or default_optimizer)
        object.__setattr__(self, "metrics", check_metrics(self.metrics))
        object.__setattr__(self, "weights", _weights_path(self.weights))


def _check_fp8(recipe: Any, head: bool, chunked: bool | int) -> None:
    from meshfit.parallel.fp8 import RECIPES

    if recipe not in RECIPES:
        raise MeshfitError(
            f"fp8_recipe must be one of {', '.join(map(repr, RECIPES))} (torchao's recipe "
            f"names), not {recipe!r}"
        )
    if head and chunked is not False:
        raise MeshfitError(
            "fp8_head=True and chunked_loss together: the chunked loss computes the LM "
            "head's product itself, in bf16, so the head would not run in float8; choose "
            "one of the two"
        )


def option_names() -> list[str]:
    """The keywords `parallelize` takes besides the model, the plan and loss_fn."""
    return [f.name for f in fields(EngineOptions) if f.name != "loss_fn"]


def check_option_names(keywords: Mapping[str, Any], what: str) -> None:
    """Refuse keywords that are not parallelize's options, in one line: `what` names the
    caller ("fit does not take"); fit, predict and verify pass their others on."""
    unknown = sorted(set(keywords) - set(option_names()))
    if unknown:
        raise MeshfitError(
            f"{what} {', '.join(map(repr, unknown))}; the options of mf.parallelize it "
            f"passes on are: {', '.join(option_names())}"
        )


def engine_options(what: str, loss_fn: Any, keywords: Mapping[str, Any]) -> EngineOptions:
    """The EngineOptions of a caller's extra keywords (names checked first, see
    check_option_names), made and checked once, before any process group starts."""
    check_option_names(keywords, what)
    return EngineOptions(loss_fn=loss_fn, **keywords)


def _check_loss(loss_fn: Any) -> None:
    if loss_fn is None:
        raise MeshfitError(
            "parallelize needs a loss function: pass loss_fn=..., e.g. "
            "loss_fn=torch.nn.functional.cross_entropy"
        )
    if not callable(loss_fn) and loss_fn != "model":
        raise MeshfitError(
            f"loss_fn must be callable, or 'model' for the model's own loss, not "
            f"{type(loss_fn).__name__}"
        )


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        raise MeshfitError(
            "pass the optimizer as a function of the parameters, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4): parallel forms "
            "may replace the model's parameters, so meshfit builds the optimizer itself"
        )
    if optimizer is not None and not callable(optimizer):
        raise MeshfitError(f"optimizer must be a function of the parameters, not {optimizer!r}")


def _weights_path(weights: Any) -> str | None:
    """The weights to load: `weights`, else `meshfit run --weights` (MESHFIT_WEIGHTS)."""
    if weights is None:
        return os.environ.get("MESHFIT_WEIGHTS")
    if not isinstance(weights, (str, os.PathLike)):
        raise MeshfitError(f"weights must be a path to safetensors, not {weights!r}")
    return os.fspath(weights)
