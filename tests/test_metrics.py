"""Metrics besides the loss, over the global batch: the same values under dp, tp, pp
(micro-batches) as in one process; fit records them for training and evaluation."""

from __future__ import annotations

import pytest
from workers import build, dataset, metric_run

import meshfit as mf


@pytest.mark.slow
def test_metrics_are_the_one_process_values_under_every_plan() -> None:
    plans = ["dp=2", "tp=2", "pp=2"]
    results = mf.launch(_many, nproc=2, args=(plans,))
    ref = metric_run(None)["metrics"]
    assert ref[0]["acc"] > 0  # something was counted
    for plan, got in zip(plans, results, strict=True):
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert a["acc"] == b["acc"], (plan, step)  # counts: exact
            assert a["mean_abs"] == pytest.approx(b["mean_abs"], rel=1e-12), (plan, step)


def _many(plans: list[str]) -> list[list[dict]]:
    return [metric_run(plan)["metrics"] for plan in plans]


def test_fit_records_training_and_evaluation_metrics() -> None:
    model, loss_fn = build("mlp")
    history = mf.fit(
        model,
        dataset("mlp", 32),
        loss_fn=loss_fn,
        batch_size=8,
        max_steps=4,
        eval_dataset=dataset("mlp", 16),
        eval_every=2,
        metrics={"acc": mf.metrics.accuracy},
        progress=False,
    )
    assert all(0.0 <= r["acc"] <= 1.0 for r in history.records)
    assert [r["step"] for r in history.records if "eval_acc" in r] == [2, 4]


def test_bad_metrics_are_refused() -> None:
    model, loss_fn = build("mlp")
    with pytest.raises(mf.MeshfitError, match="metrics must be a dict of name -> fn"):
        mf.parallelize(model, None, loss_fn=loss_fn, metrics=[mf.metrics.accuracy])
    with pytest.raises(mf.MeshfitError, match=r"\['eval_acc'\] clash with fit's own"):
        mf.parallelize(model, None, loss_fn=loss_fn, metrics={"eval_acc": mf.metrics.accuracy})
