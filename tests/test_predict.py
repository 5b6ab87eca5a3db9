"""Inference after training under any plan: engine.predict gives the one-process
outputs of the whole batch, in the model's own form, on every rank."""

from __future__ import annotations

import pytest
import torch
from workers import build, hf_llama, make_batch, predict_runs

import meshfit as mf

pytest.importorskip("transformers")


def test_predict_gives_the_one_process_outputs_under_every_plan() -> None:
    plans = ["dp=2", "tp=2", "pp=2"]
    results = mf.launch(predict_runs, nproc=2, args=(plans,))
    gpt = build("gpt4")[0]
    llama = hf_llama().double()
    with torch.no_grad():
        ref_gpt = gpt(make_batch("gpt4", 8, 0)[0])
        ref_llama = llama(input_ids=make_batch("gpt4", 8, 1)[0]).logits
    for plan, got in zip(plans, results, strict=True):
        assert got["kind"] == "CausalLMOutputWithPast", plan  # the model's own form
        torch.testing.assert_close(got["gpt"], ref_gpt, rtol=1e-12, atol=1e-12, msg=plan)
        torch.testing.assert_close(got["llama"], ref_llama, rtol=1e-12, atol=1e-12, msg=plan)


def test_predict_refuses_a_batch_it_cannot_split() -> None:
    model, loss_fn = build("mlp")
    engine = mf.parallelize(model, "microbatches=1", loss_fn=loss_fn)
    assert engine.predict(torch.zeros(3, 8, dtype=torch.float64)).shape == (3, 5)
    with pytest.raises(mf.MeshfitError, match="predict needs the model's inputs"):
        engine.predict({"x": 1})
