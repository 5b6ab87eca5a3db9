"""Data parallel and gradient accumulation reproduce the single-process run."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_run, max_weight_error, relative_error
from workers import build, engine_run, many_engine_runs

import meshfit as mf

BATCH = 16
STEPS = 4


def reference(spec: dict) -> dict:
    return engine_run({**spec, "plan": "dp=1"})


def _specs(plan: str) -> list[dict]:
    return [
        {"model": "mlp", "plan": plan, "batch": BATCH, "steps": STEPS},
        {"model": "gpt", "plan": plan, "batch": BATCH, "steps": STEPS},
        {"model": "gpt", "plan": plan + ",microbatches=2", "batch": BATCH, "steps": STEPS},
        {
            "model": "gpt",
            "plan": plan,
            "batch": BATCH,
            "steps": STEPS,
            "optimizer": "adamw",
            "grad_clip": 0.05,
        },
    ]


@pytest.mark.parametrize("nproc", [2, 4])
def test_data_parallel_matches_one_process(nproc: int) -> None:
    specs = _specs(f"dp={nproc}")
    results = mf.launch(many_engine_runs, nproc=nproc, args=(specs,))
    for spec, got in zip(specs, results, strict=True):
        ref = reference({**spec, "plan": None})
        assert_same_run(got, ref)
        assert abs(got["eval"] - ref["eval"]) <= 1e-5 * abs(ref["eval"])
        # The run really trained (a comparison of untouched weights proves nothing).
        initial = build(spec["model"])[0].state_dict()
        assert max(relative_error(ref["state"][k], initial[k]) for k in initial) > 1e-2


def test_gradient_accumulation_matches_one_big_batch() -> None:
    for model in ("mlp", "gpt"):
        one = engine_run({"model": model, "plan": "dp=1", "batch": BATCH, "steps": STEPS})
        two = engine_run({"model": model, "plan": "dp=1,microbatches=2", "batch": BATCH,
                          "steps": STEPS})  # fmt: skip
        four = engine_run({"model": model, "plan": "dp=1,microbatches=4", "batch": BATCH,
                           "steps": STEPS})  # fmt: skip
        assert_same_run(two, one)
        assert_same_run(four, one)


def test_comparison_detects_a_different_run() -> None:
    """Negative control: a run on other data must fail the same tolerance."""
    ref = engine_run({"model": "gpt", "batch": BATCH, "steps": STEPS})
    other = engine_run({"model": "gpt", "batch": BATCH // 2, "steps": STEPS})
    assert max_weight_error(other, ref) > 1e-3
    with pytest.raises(AssertionError):
        assert_same_run(other, ref)


def test_bf16_and_fp16_train_close_to_fp32() -> None:
    ref = engine_run({"model": "gpt", "batch": BATCH, "steps": STEPS})
    for precision in ("bf16", "fp16"):
        got = engine_run({"model": "gpt", "plan": f"precision={precision}", "batch": BATCH,
                          "steps": STEPS})  # fmt: skip
        assert all(torch.isfinite(torch.tensor(got["losses"])))
        # Reduced precision is not bit-equal, but must follow the same run closely.
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)) < 0.05
