"""bf16 matrix products left uncomputed, for memory rows on a CPU that has none.

Where oneDNN has no bf16 kernels (a CPU without AVX-512: meshfit.runtime.precision.
bf16_products_are_native() is False), torch falls back to a scalar gemm for bf16: the LM
head's input gradient at 128k words for 512 tokens ([512, 128256] x [128256, 256]) took
94 s there against 0.09 s with oneDNN (this VM, `ONEDNN_MAX_CPU_ISA=AVX2` against its
default, 2026-12-02), and tests/test_planner_memory.py's chunked check took 58 minutes of
a 103-minute suite on such a VM. Its rows measure memory, which does not depend on the
products' values: under `products_as_zeros()` every bf16 mm/addmm/bmm/baddbmm returns
zeros of its own shape (the same allocation as the product's), eager (a dispatch mode)
and compiled (Inductor's generated code calls the `extern_kernels` products, patched
here; a dispatch mode would make Dynamo run the graph eagerly). Measured equal to the
computed step where both run (tests/test_planner_memory.py checks it): bf16 Llama rows
at 32k whole 650,734,948 B, 128k chunked 1,702,949,750 B, 128k chunked compiled
1,339,846,016 B, either way. Under the same emulation the chunked check took 96 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Each product's output shape from its positional arguments (a bias or input first for
# the add- forms: it broadcasts, the shape is the product's; beta and alpha are keywords).
_SHAPES = {
    _aten.mm: lambda a, b: (a.shape[0], b.shape[1]),
    _aten.addmm: lambda _, a, b: (a.shape[0], b.shape[1]),
    _aten.bmm: lambda a, b: (a.shape[0], a.shape[1], b.shape[2]),
    _aten.baddbmm: lambda _, a, b: (a.shape[0], a.shape[1], b.shape[2]),
}
# How many products each way left uncomputed (a stand-in that never took effect would
# measure the computed step's peak too: the test counts these).
replaced = {"eager": 0, "compiled": 0}


def _bf16(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)


class _Zeros(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet not in _SHAPES or not _bf16(args):
            return func(*args, **kwargs)
        replaced["eager"] += 1
        if kwargs.get("out") is not None:
            return kwargs["out"].zero_()
        return torch.zeros(_SHAPES[packet](*args), dtype=torch.bfloat16, device=args[0].device)


def _zeroed(real):  # noqa: ANN001, ANN202
    def product(*args, out=None, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if out is not None and out.dtype == torch.bfloat16:
            replaced["compiled"] += 1
            return out.zero_()
        return real(*args, out=out, **kwargs)

    return product


@contextlib.contextmanager
def products_as_zeros(compiled: bool) -> Iterator[None]:
    """bf16 products as zeros of their shape inside: through Inductor's extern kernels
    when `compiled`, else through a dispatch mode."""
    if not compiled:
        with _Zeros():
            yield
        return
    import torch._inductor.kernel.bmm  # noqa: F401 - they register the extern kernels
    import torch._inductor.kernel.mm  # noqa: F401
    from torch._inductor.select_algorithm import extern_kernels

    saved = {name: getattr(extern_kernels, name) for name in ("mm", "addmm", "bmm", "baddbmm")}
    for name, real in saved.items():
        setattr(extern_kernels, name, _zeroed(real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(extern_kernels, name, real)
