"""Inference after training under any plan: engine.predict gives the one-process
outputs of the whole batch, in the model's own form, on every rank; mf.predict does it
from a model and a checkpoint, with inputs of any size."""

from __future__ import annotations

import pytest
import torch
from workers import build, dataset, hf_llama, make_batch, mf_predict_runs, predict_runs

import meshfit as mf

pytest.importorskip("transformers")


@pytest.mark.slow
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


def _trained(tmp_path, kind: str) -> tuple[mf.History, torch.nn.Module]:
    """A short fit with checkpoints, and a one-process copy of the trained model."""
    model, loss_fn = build(kind)
    history = mf.fit(
        model,
        dataset(kind, 32),
        loss_fn=loss_fn,
        batch_size=8,
        max_steps=3,
        checkpoint_dir=str(tmp_path / "ck"),
        progress=False,
    )
    reference = build(kind)[0]
    reference.load_state_dict(history.engine.full_state_dict())
    return history, reference.eval()


def test_mf_predict_loads_the_weights_and_batches_the_inputs(tmp_path) -> None:
    history, reference = _trained(tmp_path, "mlp")
    inputs = make_batch("mlp", 37, 9)[0]  # 4 batches of 10 and a last one of 7
    with torch.no_grad():
        expected = reference(inputs)
    ck = str(tmp_path / "ck")
    got = mf.predict(build("mlp")[0], inputs, checkpoint=ck, batch_size=10)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # a fresh model's own weights give other outputs
        assert not torch.allclose(build("mlp")[0](inputs), expected)
    # safetensors from save_model, a Dataset of input rows, the engine that trained
    history.engine.save_model(str(tmp_path / "export"))
    rows = [inputs[i] for i in range(len(inputs))]
    got = mf.predict(build("mlp")[0], rows_dataset(rows), checkpoint=str(tmp_path / "export"))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        mf.predict(history.engine, inputs, batch_size=16), expected, rtol=1e-12, atol=1e-12
    )


def test_mf_predict_refuses_what_it_cannot_do_with_the_fix(tmp_path) -> None:
    history, _ = _trained(tmp_path, "mlp")
    deep = build("deep_mlp")[0]
    with pytest.raises(mf.MeshfitError, match="does not fit this model: missing 6.weight"):
        mf.predict(deep, torch.zeros(2, 8), checkpoint=str(tmp_path / "ck"))
    with pytest.raises(mf.MeshfitError, match=r"pass the model: mf.predict\(model"):
        mf.predict(history.engine, torch.zeros(2, 8), checkpoint=str(tmp_path / "ck"))
    with pytest.raises(mf.MeshfitError, match="does not train: optimizer"):
        mf.predict(build("mlp")[0], torch.zeros(2, 8), optimizer=torch.optim.SGD)
    with pytest.raises(mf.MeshfitError, match="batch_size must be a whole number"):
        mf.predict(build("mlp")[0], torch.zeros(2, 8), batch_size=0)


def test_mf_predict_under_every_plan_gives_the_one_process_outputs(tmp_path) -> None:
    _, reference = _trained(tmp_path, "gpt4")
    with torch.no_grad():
        expected = reference(make_batch("gpt4", 13, 5)[0])
    plans = ["dp=2", "tp=2", "pp=2"]
    results = mf.launch(mf_predict_runs, nproc=2, args=(str(tmp_path / "ck"), plans))
    for plan, got in zip(plans, results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=plan)


class rows_dataset(torch.utils.data.Dataset):  # noqa: N801 (reads as a function)
    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]
