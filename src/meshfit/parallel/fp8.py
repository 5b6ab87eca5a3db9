"""precision="fp8": float8 training through torchao (the optional extra meshfit[fp8]).

fp8 training is bf16 training (autocast; FSDP2 gathers bf16 copies and reduces fp32
gradients) in which the model's large nn.Linear layers become torchao's Float8Linear:
their matrix products run in float8 with dynamic scales (tensor-wise by default, rowwise
with `fp8_recipe`; e4m3 for inputs and weights, e5m2 for gradients), on the fp8 tensor cores of an H100 / Ada GPU (CUDA
capability 8.9 or later). Everything else, the master weights and the optimizer stay as
they are. This is torchtitan's float8 recipe: convert first, then the parallel forms.

Which layers are converted (`convertible`): the nn.Linear layers inside the model's
repeated blocks (meshfit.parallel.blocks; every layer of a model without them) whose two
dimensions are multiples of 16 (what the fp8 matmul needs), but not the model's last
Linear, its output layer / LM head: it stays in bf16, as torchtitan keeps its "output"
layer, unless `fp8_head=True` asks for it too (at a 128k vocabulary the head is a fifth
of a 1B model's FLOPs; a lever issue 50 asks measured on a GPU).

How the scales are taken (`fp8_recipe`, torchao's recipe names): "tensorwise" (the
default: one scale per tensor), "rowwise" (one per row: more accurate, torchao's choice
for large runs) or "rowwise_with_gw_hp" (rowwise, the weights' gradient product in
bf16). Which is fastest for a model is a measurement, not a rule.

Float8Linear is an nn.Linear subclass that keeps `weight` and `bias` as ordinary
parameters under the same names, so state dicts and checkpoints load into the plain
model as they were.

MESHFIT_FP8_EMULATE=1 runs the same path where there is no fp8 hardware (CPU, older
GPUs): torchao's emulate mode computes the float8 roundings in higher precision. It is
for tests and debugging only: slower than bf16, never faster (set on fp8 hardware, it
warns once). A model in which nothing converts is refused (`refuse_if_nothing_converts`):
it would train plain bf16 under the name fp8.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError

EMULATE_ENV = "MESHFIT_FP8_EMULATE"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName
# The range meshfit[fp8] declares (pyproject.toml) and the tests ran: 0.18.0.
TORCHAO_MIN = "0.18"
_MULTIPLE = 16  # both dimensions of a float8 matmul


def emulating() -> bool:
    """Whether MESHFIT_FP8_EMULATE asks for torchao's emulated float8 (tests only)."""
    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes")


_warned_emulating = False


def check_available(device: torch.device) -> bool:
    """Refuse fp8 where it cannot run, naming the fix; return whether to emulate.
    Warns (once per process) when MESHFIT_FP8_EMULATE is set on fp8 hardware."""
    global _warned_emulating
    emulate = emulating()
    hardware = has_fp8_hardware(device)
    if not emulate and not hardware:
        raise MeshfitError(
            f"precision='fp8' needs a GPU with float8 matmuls (CUDA capability 8.9 or "
            f"later: H100, H200, L4, L40, RTX 4090), but this process runs on "
            f"{_describe(device)}; use precision='bf16' here (or {EMULATE_ENV}=1 to "
            f"emulate float8 for tests and debugging only: slower, never faster)"
        )
    if emulate and hardware and not _warned_emulating:
        _warned_emulating = True
        warnings.warn(
            f"{EMULATE_ENV}=1 emulates float8 on {_describe(device)}, which has float8 "
            f"matmuls: emulation is slower than bf16, and the real fp8 path is available "
            f"here; unset {EMULATE_ENV} to use it",
            stacklevel=3,
        )
    _import_torchao()
    return emulate


def has_fp8_hardware(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _describe(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (capability {major}.{minor})"
    return f"a {device.type.upper()} device" if device.type != "cpu" else "the CPU"


def _import_torchao() -> Any:
    """torchao.float8, or a refusal that says how to install it."""
    # At import torchao logs a warning per CUDA kernel library it cannot load (all of
    # them on a CPU build of torch) and torch one about an Enum torchao registers;
    # float8 training needs neither.
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise MeshfitError(
            f"precision='fp8' trains through torchao's float8, which is not installed "
            f"({e}); pip install 'meshfit[fp8]' (torchao>={TORCHAO_MIN})"
        ) from None
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
    return float8


def convertible(model: nn.Module, head: bool = False) -> list[str]:
    """Names of the nn.Linear layers fp8 converts (see the module's docstring); `head`:
    the output layer too."""
    from meshfit.parallel.blocks import find_blocks

    try:
        blocks = list(find_blocks(model).blocks)
    except MeshfitError:
        blocks = []
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    output = linears[-1:]  # the last one registered: the output layer / LM head
    linears = linears[:-1]
    if blocks:
        inside = {id(m) for b in blocks for m in b.modules()}
        linears = [(n, m) for n, m in linears if id(m) in inside]
    if head:
        linears += output
    fits = [
        (n, m) for n, m in linears if m.in_features % _MULTIPLE == m.out_features % _MULTIPLE == 0
    ]
    return [n for n, _ in fits]


def refuse_if_nothing_converts(model: nn.Module, head: bool = False) -> None:
    """Refuse precision="fp8" for a model in which `convert` would convert nothing (it
    would train plain bf16 under the name fp8), before the model is changed. A model that
    already holds Float8Linear layers (an earlier fp8 run) passes: those run in float8."""
    if head:
        _refuse_an_unconvertible_head(model)
    if convertible(model, head) or any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        return
    raise MeshfitError(
        f"precision='fp8' found no nn.Linear in the model's blocks whose sizes are "
        f"multiples of {_MULTIPLE} ({_why_none(model)}), so nothing would run in float8: "
        f"use precision='bf16'"
    )


def _refuse_an_unconvertible_head(model: nn.Module) -> None:
    """fp8_head=True where the output layer cannot run in float8: said, not ignored."""
    output = [m for m in model.modules() if type(m) is nn.Linear][-1:]
    if not output:
        raise MeshfitError(
            f"fp8_head=True, but {type(model).__name__} has no nn.Linear output layer to "
            f"convert; drop fp8_head"
        )
    head = output[0]
    if head.in_features % _MULTIPLE or head.out_features % _MULTIPLE:
        raise MeshfitError(
            f"fp8_head=True, but the output layer is {head.in_features}->"
            f"{head.out_features}: float8 matmuls need both sizes to be multiples of "
            f"{_MULTIPLE}; pad the vocabulary to a multiple of {_MULTIPLE} (as GPT-2's "
            f"50257 is padded to 50304), or drop fp8_head"
        )


def _why_none(model: nn.Module) -> str:
    """What `convertible` saw, for the refusal."""
    from meshfit.parallel.blocks import find_blocks

    try:
        blocks = list(find_blocks(model).blocks)
    except MeshfitError:
        blocks = []
    scope = [m for b in blocks for m in b.modules()] if blocks else list(model.modules())
    where = "its repeated blocks" if blocks else "the model (no repeated blocks found)"
    output = [m for m in model.modules() if type(m) is nn.Linear][-1:]  # stays bf16
    linears = [m for m in scope if type(m) is nn.Linear and m not in output]
    if linears:
        sizes = sorted({f"{m.in_features}->{m.out_features}" for m in linears})
        return (
            f"the nn.Linear layers of {where} have sizes {', '.join(sizes[:4])}"
            f"{', ...' if len(sizes) > 4 else ''}; float8 matmuls need both sizes to be "
            f"multiples of {_MULTIPLE}"
        )
    kinds = sorted(
        {type(m).__name__ for m in scope if isinstance(getattr(m, "weight", None), nn.Parameter)}
        - {"LayerNorm", "RMSNorm", "Embedding", "BatchNorm1d", "BatchNorm2d"}
    )
    other = f"; their layers with weights are {', '.join(kinds[:4])}" if kinds else ""
    if "Conv1D" in kinds:
        other += " (HF GPT-2's Conv1D is not an nn.Linear)"
    return f"{where} hold no nn.Linear but the output layer{other}"


def refuse_fp8_options(recipe: str, head: bool, precision: str) -> None:
    """fp8_recipe and fp8_head say how precision="fp8" runs: refused under another
    precision, where they would change nothing."""
    given = [f"fp8_recipe={recipe!r}"] * (recipe != "tensorwise") + ["fp8_head=True"] * head
    if given:
        raise MeshfitError(
            f"{' and '.join(given)} apply to precision='fp8', but the plan's precision is "
            f"{precision!r}: add precision=fp8 to the plan, or drop {' and '.join(given)}"
        )


def warn_if_converted(model: nn.Module) -> None:
    """Under a precision other than fp8: say so when the model already holds Float8Linear
    layers (an earlier precision="fp8" run converted them in place, or torchao did)."""
    found = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    if found:
        warnings.warn(
            f"the model holds {len(found)} Float8Linear layers ({found[0]}, ...), from an "
            f"earlier precision='fp8' run or torchao: they keep computing in float8 under "
            f"this plan's precision; build the model afresh (or load its state dict into "
            f"a new one: the names are the same) for a run without float8",
            stacklevel=4,
        )


def convert(
    model: nn.Module, emulate: bool, recipe: str = "tensorwise", head: bool = False
) -> list[str]:
    """Swap the convertible Linears of `model` (the output layer too with `head`) for
    Float8Linear with `recipe`'s scales, in place (before any parallel form, as
    torchtitan does). Returns their names."""
    import dataclasses

    float8 = _import_torchao()
    names = set(convertible(model, head))
    if not names:
        return []
    if emulate and recipe == "rowwise_with_gw_hp":
        raise MeshfitError(
            f"fp8_recipe='rowwise_with_gw_hp' cannot be emulated ({EMULATE_ENV}=1: torchao "
            f"mixes bf16 and float32 in its emulated product); emulate 'tensorwise' or "
            f"'rowwise', or run it on a GPU with float8 matmuls"
        )
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _m, fqn: fqn in names
    )
    return sorted(names)
