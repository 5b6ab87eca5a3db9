"""A model's own state-dict hooks (a fused q|k|v saved as wq / wk / wv): checkpoints,
the gathered state, exported safetensors and weights= under one process and under
fsdp=2 and pp=2, against one process."""

from __future__ import annotations

import os
import warnings

import pytest
import renaming
import torch

import meshfit as mf


def _unfused_names(state: dict) -> None:
    assert not any(k.endswith("wqkv.weight") for k in state), list(state)
    assert "layers.0.attention.wq.weight" in state, list(state)


def test_a_model_that_renames_its_tensors_saves_loads_and_exports_in_one_process(
    tmp_path,
) -> None:
    reference = renaming.engine(None)
    losses = [float(reference.step(renaming.batch(step))) for step in range(4)]

    run = renaming.engine(None)
    for step in range(2):
        run.step(renaming.batch(step))
    run.save(str(tmp_path / "ck"))  # torch's get_state_dict failed on the hooks' names
    resumed = renaming.engine(None)
    resumed.load(str(tmp_path / "ck"))
    after = [float(resumed.step(renaming.batch(step))) for step in (2, 3)]
    assert after == losses[2:]

    state = resumed.full_state_dict()
    assert state.keys() == resumed.user_model.state_dict().keys()  # the model's own names
    _unfused_names(state)
    for key, value in resumed.user_model.state_dict().items():
        assert torch.equal(state[key], value), key

    resumed.save_model(str(tmp_path / "export"), max_shard_size=2048)
    files = os.listdir(tmp_path / "export")
    assert "model.safetensors.index.json" in files and len(files) > 3, files
    loaded = renaming.engine(None, weights=str(tmp_path / "export"))  # through _fuse
    for key, value in loaded.full_state_dict().items():
        assert torch.equal(value, state[key]), key

    # mf.predict reads either into a whole model: the checkpoint under the modules'
    # names, the export through the model's hooks
    inputs = renaming.batch(9)[0]
    for source, trained in (("ck", run), ("export", resumed)):
        got = mf.predict(renaming.built(), inputs, checkpoint=str(tmp_path / source))
        assert torch.equal(got, trained.predict(inputs)), source

    with torch.device("meta"):
        on_meta = renaming.Transformer().to(torch.float64)
    with pytest.raises(mf.MeshfitError, match="changes the names it loads") as refused:
        mf.parallelize(on_meta, loss_fn=renaming.loss_fn, weights=str(tmp_path / "export"))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("plans", [["fsdp=2", "pp=2"]])
def test_a_model_that_renames_its_tensors_trains_saves_and_exports_under_fsdp_and_pp(
    tmp_path, plans
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(renaming.runs, nproc=2, args=(plans, str(tmp_path)))
    reference = renaming.engine(None)
    losses = [float(reference.step(renaming.batch(step))) for step in range(3)]
    expected = reference.user_model.state_dict()
    for plan, got in zip(plans, results, strict=True):
        assert got["losses"] == pytest.approx(losses, rel=1e-12, abs=0), plan
        _unfused_names(got["state"])
        assert got["state"].keys() == expected.keys(), plan
        for key, value in expected.items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-12, atol=1e-14)
        # its checkpoint resumes in one process; its export loads through the hooks
        resumed = renaming.engine(None)
        resumed.load(str(tmp_path / f"{plan}-ck"))
        loaded = renaming.engine(None, weights=str(tmp_path / f"{plan}-export"))
        for key, value in expected.items():
            torch.testing.assert_close(
                resumed.full_state_dict()[key], value, rtol=1e-12, atol=1e-14
            )
            torch.testing.assert_close(loaded.full_state_dict()[key], value, rtol=1e-12, atol=1e-14)
