"""The trained model as a plain file: safetensors from a live run (`engine.save_model`,
any plan) and from a checkpoint alone (`meshfit export`), loadable with
`load_file` + `load_state_dict`, and with `from_pretrained` for a Hugging Face model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from workers import build_lm, export_run

import meshfit as mf

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


@pytest.mark.slow
def test_a_pipeline_trained_model_exports_whole_and_loads_anywhere(tmp_path) -> None:
    state = mf.launch(export_run, nproc=2, args=("pp=2", str(tmp_path)))
    # from the live run: the stages gathered, the tied embedding under both names
    saved = safetensors.load_file(str(tmp_path / "model" / "model.safetensors"))
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)
    fresh = build_lm("gpt2", "float32")
    fresh.load_state_dict(saved)  # strict: every name there
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "model"))
    assert torch.equal(loaded.lm_head.weight, state["lm_head.weight"])
    # from the checkpoint alone, by the command line
    out = tmp_path / "exported.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "meshfit", "export", str(tmp_path / "checkpoint"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "exported the step-1 model" in done.stdout
    exported = safetensors.load_file(str(out))
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)
    # into Hugging Face-style shards, streamed: one file's tensors read, written, freed
    from meshfit.planner.memory_probe import measure_peak
    from meshfit.state.export import export_checkpoint

    shards = tmp_path / "shards"
    peak = measure_peak(lambda: export_checkpoint(str(tmp_path / "checkpoint"), str(shards), "4KB"))
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3, (files, peak.total)
    parts = {}
    for name in files:
        parts.update(safetensors.load_file(str(shards / name)))
    assert parts.keys() == state.keys()
    assert all(torch.equal(parts[k], state[k]) for k in state)
    whole = sum(t.numel() * t.element_size() for t in state.values())
    assert peak.total < whole / 2, (peak.total, whole)  # never the whole model at once


@pytest.mark.slow
def test_export_of_a_missing_checkpoint_is_one_line(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshfit", "export", str(tmp_path / "nope"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"meshfit: error: no checkpoint at {str(tmp_path / 'nope')!r}: the path does not exist"
    )
