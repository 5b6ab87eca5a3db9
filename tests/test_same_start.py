"""Workers that built other initial weights (no seed before the build) start from rank
0's under every form, as DDP already made them for dp: before, fsdp=2 trained a model
stitched from each rank's shard of its own draw (weights 9e-2 off one process, with no
word), and tp=2's split check blamed the split."""

from __future__ import annotations

import pytest
from helpers import assert_same_run
from workers import unseeded_runs

import meshfit as mf


@pytest.mark.slow
def test_workers_that_drew_other_weights_train_rank0s_run_under_every_form() -> None:
    plans = ["fsdp=2", "tp=2", "pp=2,microbatches=2", "dp=2"]
    specs = [{"model": "gpt4", "plan": p} for p in plans]
    specs.append({"model": "gpt4", "plan": "fsdp=2", "keep_own": True})  # negative control
    # another model on one worker: refused on every rank, nothing broadcast into it
    specs.append({"model": "mlp", "plan": "fsdp=2", "model_on_rank1": "deep_mlp"})
    *runs, own, other = mf.launch(unseeded_runs, nproc=2, args=(specs,))
    assert other["refused"].startswith(
        "the workers built different models: rank 1's has '4.weight (32, 32)"
    ), other
    reference = unseeded_runs([{"model": "gpt4", "plan": None}])[0]
    assert reference["warned"] == []
    for got in runs:
        assert_same_run(got, reference)
        assert len(got["warned"]) == 1 and "1 of 2 workers" in got["warned"][0], got["warned"]
    with pytest.raises(AssertionError):
        assert_same_run(own, reference)
