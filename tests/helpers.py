"""Numerical comparison used by every equivalence test."""

from __future__ import annotations

import torch

RTOL = 1e-5  # DESIGN.md: fp32 on CPU, up to float reassociation


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, the tensor-wise relative error (elementwise relative error is
    meaningless for entries near zero)."""
    a, b = a.double(), b.double()
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


def assert_same_run(got: dict, ref: dict, rtol: float = RTOL) -> None:
    """Same per-step losses and same final weights, within `rtol` relative."""
    assert len(got["losses"]) == len(ref["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs {b}"
    assert got["state"].keys() == ref["state"].keys()
    for name in ref["state"]:
        err = relative_error(got["state"][name], ref["state"][name])
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def max_weight_error(got: dict, ref: dict) -> float:
    return max(relative_error(got["state"][k], ref["state"][k]) for k in ref["state"])
