"""Workers that built other initial weights (no seed before the build) start from rank
0's under every form, as DDP already made them for dp: before, fsdp=2 trained a model
stitched from each rank's shard of its own draw (weights 9e-2 off one process, with no
word), and tp=2's split check blamed the split."""

from __future__ import annotations

import pytest
import torch
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


def test_the_fingerprint_samples_tensors_past_float32s_integers() -> None:
    # A 128,256-word embedding of width 256 (32,833,536 elements, above 2**24): the
    # sampled indices were a float32 linspace whose last one rounded up to the tensor's
    # length, and every multi-rank plan of such a model failed on its first step.
    from meshfit.weights.same_start import SAMPLES, _evenly_spaced, fingerprint

    for numel in (0, 1, 5, SAMPLES, 2**24 + 1, 128256 * 256, 2**40 + 7):
        picks = _evenly_spaced(numel)
        assert len(picks) == min(numel, SAMPLES) and len(set(picks.tolist())) == len(picks)
        if numel:
            assert picks[0] == 0 and picks[-1] == numel - 1, (numel, picks[-3:])
    big = torch.nn.Module()  # 2**24 + 4: the float32 linspace's last index was its length
    big.register_buffer("ids", torch.zeros(2**24 + 4, dtype=torch.uint8))
    _, before = fingerprint(big)
    big.ids[-1] = 1  # the last element is sampled
    assert fingerprint(big)[1] != before
