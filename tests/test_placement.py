"""mf.place: submodules on chosen devices of one process, inputs moved for them."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_run
from workers import build, make_batch, optimizer_factory

import meshfit as mf


def _train(model, loss_fn, steps: int = 3) -> dict:
    engine = mf.parallelize(model, "dp=1", optimizer=optimizer_factory("sgd"), loss_fn=loss_fn)
    losses = [float(engine.step(make_batch("gpt", 8, step))) for step in range(steps)]
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state}


def _placements() -> list[dict[str, str]]:
    if torch.cuda.is_available():
        return [
            {"blocks.0": "cuda:0", "lm_head": "cuda:0"},  # the rest stays on the CPU
            {
                "tok_emb": "cuda:0",
                "pos_emb": "cuda:0",
                "blocks": "cpu",
                "ln_f": "cuda:0",
                "lm_head": "cuda:0",
            },
        ]
    return [{"blocks.0": "cpu", "lm_head": "cpu"}]


@pytest.mark.parametrize("placement", _placements())
def test_placed_model_trains_like_the_unplaced_one(placement) -> None:
    ref = _train(*build("gpt"))
    model, loss_fn = build("gpt")
    mf.place(model, placement)
    for name, device in placement.items():
        assert next(model.get_submodule(name).parameters()).device == torch.device(device)
    got = _train(model, loss_fn)
    assert_same_run(got, ref, rtol=1e-4 if torch.cuda.is_available() else 1e-6)


def test_place_refuses_unknown_modules_and_devices() -> None:
    model, _ = build("gpt")
    with pytest.raises(mf.MeshfitError, match="no submodule 'encoder'.*tok_emb.*blocks"):
        mf.place(model, {"encoder": "cpu"})
    with pytest.raises(mf.MeshfitError, match="not a device"):
        mf.place(model, {"blocks": "gpu-zero"})
    if torch.cuda.device_count() < 8:
        with pytest.raises(mf.MeshfitError, match="cuda:7.*this process sees"):
            mf.place(model, {"blocks": "cuda:7"})
