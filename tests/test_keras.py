"""Keras 3 models (torch backend), unchanged: dp and fsdp train the one-process run (under
fsdp the layers read the parameters FSDP2 gathers: parallel/keras_weights.py); what
cannot work is refused before the first update, in one line (a Keras
BatchNormalization, whose statistics meshfit cannot compute over a split batch)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":  # pragma: no cover - another backend chosen
    pytest.skip("Keras runs on another backend here", allow_module_level=True)

from workers import keras_run, many_keras_runs  # noqa: E402

import meshfit as mf  # noqa: E402

REFUSED = {
    ("keras_bn", "dp=2"): "layer 'batch_normalization' is a Keras BatchNormalization",
}


@pytest.mark.slow
def test_keras_models_train_under_dp_and_fsdp_or_are_refused_before_any_update() -> None:
    specs = [
        {"model": "keras_mlp", "plan": "dp=2"},
        {"model": "keras_mlp", "plan": "fsdp=2"},
        {"model": "keras_bn", "plan": "dp=2"},
    ]
    results = mf.launch(many_keras_runs, nproc=2, args=(specs,))
    for spec, got in zip(specs, results, strict=True):
        refusal = REFUSED.get((spec["model"], spec["plan"]))
        if refusal is not None:
            assert "refused" in got and refusal in got["refused"], (spec, got)
            assert "\n" not in got["refused"]
            continue
        ref = keras_run({**spec, "plan": None})
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), spec
        assert len(got["weights"]) == len(ref["weights"])
        for a, b in zip(got["weights"], ref["weights"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the same Keras BatchNormalization model in one process trains (nothing is split)
    assert keras_run({"model": "keras_bn", "plan": None})["losses"][0] > 0
