"""Data parallel and gradient accumulation reproduce the single-process run."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_same_run,
    check_against_one_process,
    make_spec,
    max_weight_error,
    tolerance,
)
from workers import engine_run, many_engine_runs

import meshfit as mf

BATCH = 16
STEPS = 4
# A gradient one part in a million too large: what the float64 comparison must catch
# (float32's noise floor, 1e-5, would hide it).
SLIGHTLY_WRONG = 1 + 1e-6


def _specs(plan: str) -> list[dict]:
    return [
        make_spec("mlp", plan),
        make_spec("gpt", plan),
        make_spec("gpt", plan + ",microbatches=2"),
        make_spec("gpt", plan, optimizer="adamw", grad_clip=0.05),
        # the float32 path too, at the float32 tolerance (helpers.py)
        make_spec("gpt", plan, dtype="float32"),
        make_spec("mlp", plan + ",microbatches=2", dtype="float32", optimizer="adamw"),
        # bf16 autocast against bf16 in one process: per-rank gradients are rounded on
        # their own, about u = 2^-8 apart (see test_bf16_and_fp16_train_close_to_fp32)
        make_spec(
            "gpt",
            plan + ",precision=bf16",
            dtype="float32",
            rtol=2 * 2.0**-8,
            reference_plan="precision=bf16",
        ),
    ]


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_data_parallel_matches_one_process(nproc: int) -> None:
    specs = _specs(f"dp={nproc}")
    wrong = make_spec("gpt", f"dp={nproc}", grad_scale=SLIGHTLY_WRONG)
    results = mf.launch(many_engine_runs, nproc=nproc, args=([*specs, wrong],))
    check_against_one_process(specs, results[:-1])
    # Negative control through the parallel path: the slightly wrong gradient must fail.
    with pytest.raises(AssertionError):
        assert_same_run(results[-1], engine_run({**wrong, "plan": None, "grad_scale": 1.0}))


def test_gradient_accumulation_matches_one_big_batch() -> None:
    for model in ("mlp", "gpt"):
        one = engine_run(make_spec(model, "dp=1"))
        for micro in (2, 4):
            assert_same_run(engine_run(make_spec(model, f"dp=1,microbatches={micro}")), one)


def test_comparison_detects_a_different_run() -> None:
    """Negative controls: a run on other data, or with a gradient scaled by 2 (what
    summing over two replicas instead of averaging does) or by as little as 1 + 1e-6,
    must fail the same tolerance."""
    ref = engine_run(make_spec("gpt", "dp=1"))
    other = engine_run(make_spec("gpt", "dp=1", batch=BATCH // 2))
    assert max_weight_error(other, ref) > 1e-3
    with pytest.raises(AssertionError):
        assert_same_run(other, ref)
    for scale in (2.0, SLIGHTLY_WRONG):
        wrong = engine_run(make_spec("gpt", "dp=1", grad_scale=scale))
        assert wrong["losses"][0] == ref["losses"][0]  # the same loss value, ...
        with pytest.raises(AssertionError):
            assert_same_run(wrong, ref)  # ... but not the same run
    # The small one is below float32's noise floor: only the float64 comparison sees it.
    assert tolerance("float64") < max_weight_error(wrong, ref) < tolerance("float32")


def test_bf16_and_fp16_train_close_to_fp32() -> None:
    """Autocast rounds the inputs of every matrix product to the format's precision
    (u = 2^-8 for bf16, 2^-11 for fp16), so each SGD update carries a relative error of
    about u, and after these steps (which move the weights by 63% relative) the weights
    and losses differ from float32 by less than u (measured: weights 0.45 u in bf16,
    0.35 u in fp16; losses 1e-6). 2 u tolerates that rounding and still fails a gradient
    twice too large (weights 0.53 off)."""
    ref = engine_run(make_spec("gpt", "dp=1", dtype="float32"))
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        u = torch.finfo(dtype).eps / 2
        spec = make_spec("gpt", f"precision={precision}", dtype="float32")
        assert_same_run(engine_run(spec), ref, rtol=2 * u)
        with pytest.raises(AssertionError):
            assert_same_run(engine_run({**spec, "grad_scale": 2.0}), ref, rtol=2 * u)
