"""Numerical comparison used by every equivalence test, and the run specs they share."""

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


BATCH = 16  # global batch of an equivalence run
STEPS = 4  # optimizer steps of an equivalence run


def make_spec(model: str, plan: str, **extra) -> dict:
    """A run for workers.engine_run: `model` (a workers.build kind) under `plan`."""
    return {"model": model, "plan": plan, "batch": BATCH, "steps": STEPS, **extra}


def check_against_one_process(specs: list[dict], results: list[dict]) -> None:
    """Each result reproduces its spec run in this one process (losses, eval loss, final
    weights), and that run really trained (else equal weights would prove nothing)."""
    from workers import build, engine_run

    for spec, got in zip(specs, results, strict=True):
        ref = engine_run({**spec, "plan": None})
        assert_same_run(got, ref)
        assert abs(got["eval"] - ref["eval"]) <= RTOL * abs(ref["eval"]), spec
        initial = build(spec["model"])[0].state_dict()
        assert max(relative_error(ref["state"][k], initial[k]) for k in initial) > 1e-2
