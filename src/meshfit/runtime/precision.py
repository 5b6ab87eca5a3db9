"""Precision: everything a Plan's `precision` decides, in one object.

"fp32" runs in the parameters' own dtype. "bf16" runs forward and backward under bf16
autocast; FSDP2 gathers bf16 copies of the sharded fp32 weights and reduces gradients in
fp32. "fp16" adds a gradient scaler (fp16's range is too small for raw gradients);
Plan.validate refuses it where the scaler does not compose (pipeline stages, FSDP2).
"fp8" is "bf16" with the model's large Linear layers in float8 (torchao, meshfit.parallel.fp8);
it is refused here, before anything is built, where there is no fp8 hardware.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

# fp8 runs bf16 autocast around the float8 matmuls of its converted Linear layers.
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


_said_slow = False  # once per process


def bf16_products_are_native() -> bool:
    """Whether torch multiplies bf16 matrices with oneDNN on this CPU (True where the
    build cannot say: nothing is said then)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def _say_if_bf16_is_slow_here(name: str, device: torch.device) -> None:
    """Say once (rank 0) that bf16 runs on a scalar fallback on this CPU: where oneDNN has
    no bf16 kernels (no AVX-512), torch multiplies bf16 matrices in a loop: an LM head's
    input gradient at 128k words took 94 s against 0.09 s (benchmarks/zero_products.py),
    and a user testing a GPU plan on such a CPU would see a step hang for minutes."""
    global _said_slow
    if _said_slow or device.type != "cpu" or _AUTOCAST_DTYPES.get(name) is not torch.bfloat16:
        return
    if bf16_products_are_native():
        return
    _said_slow = True
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(
        f"meshfit: precision={name} on this CPU: torch has no bf16 matrix products here "
        "(oneDNN has no bf16 kernels for it) and multiplies bf16 matrices in a scalar "
        "loop, 10-1000x slower than float32; the results are bf16's either way, only "
        "slower: precision='fp32' trains faster on this CPU",
        flush=True,
    )


@dataclass
class Precision:
    """Autocast, the FSDP2 mixed-precision policy and the gradient scaler of one run."""

    name: str  # one of plan.PRECISIONS
    device: torch.device
    scaler: torch.amp.GradScaler | None = field(init=False, default=None)
    fp8_emulate: bool = field(init=False, default=False)  # MESHFIT_FP8_EMULATE (tests)

    def __post_init__(self) -> None:
        _say_if_bf16_is_slow_here(self.name, self.device)
        if self.name == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)
        if self.name == "fp8":
            from meshfit.parallel.fp8 import check_available

            self.fp8_emulate = check_available(self.device)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPES.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward and loss run in."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        bf16 = self.autocast_dtype is torch.bfloat16  # bf16, and fp8 around its matmuls
        # bf16 compute reduces fp32 gradients; otherwise gradients are reduced in the
        # parameters' own dtype (float32 here would round a float64 model's gradients).
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: gradients back to their true scale."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
