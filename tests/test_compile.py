"""compile=True under every plan reproduces the one-process eager run, and really
compiles: each run reports the graphs torch.compile made in it (none would mean the
option was ignored, as it once was under pp)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_one_process, make_spec, tolerance
from workers import engine_run, many_engine_runs, runs_or_refusals

import meshfit as mf

COMPILE = {"compile": True}

# Every form on two processes, alone and with recomputation, and the schedules (the
# interleaved one runs two stages per rank, each with its own compiled blocks).
TWO_PROCESS = [
    make_spec("gpt", "dp=2", options=COMPILE),
    make_spec("gpt", "fsdp=2", options=COMPILE, optimizer="adamw"),
    make_spec("gpt", "tp=2", options=COMPILE),
    make_spec("gpt", "pp=2,schedule=gpipe", options=COMPILE),
    make_spec("gpt", "pp=2,microbatches=2", options=COMPILE),
    make_spec("gpt4", "pp=2,schedule=interleaved-1f1b,microbatches=4", options=COMPILE),
    make_spec("gpt", "fsdp=2,checkpointing=full", options=COMPILE),
    make_spec("gpt", "tp=2,checkpointing=selective", options=COMPILE),
    make_spec("gpt", "pp=2,checkpointing=full", options=COMPILE),
    # A transformers model, unchanged (rotary tables, masks, grouped-query attention).
    # Llama computes its norms and rotary tables in float32 whatever the model's dtype,
    # and compiled float32 kernels round there unlike eager ones (vectorised sin/cos,
    # fused reductions): one process compiled is already 2.8e-8 from one process eager
    # (float32's roundoff is 6e-8), so these keep the float32 tolerance (helpers.py).
    make_spec("llama", "fsdp=2", options=COMPILE, rtol=tolerance("float32")),
    make_spec("llama", "pp=2", options=COMPILE, rtol=tolerance("float32")),
    # 10 blocks a stage, each handed the KV cache by the model: compiled once, not per layer
    make_spec("llama10", "pp=2", options=COMPILE, rtol=tolerance("float32")),
]
FOUR_PROCESS = [
    make_spec("gpt4", "dp=2,tp=2", options=COMPILE),
    make_spec("gpt4", "fsdp=2,pp=2", options=COMPILE),
    make_spec("gpt4", "tp=2,pp=2", options=COMPILE),
]


def _check(specs: list[dict], results: list[dict]) -> None:
    for spec, got in zip(specs, results, strict=True):
        assert got["compiled_graphs"] > 0, f"{spec['plan']}: compile=True compiled nothing"
        # something compiled on every rank (and no function hit torch's recompile limit:
        # the workers make that an error, workers.engine_run)
        assert all(got["compiled_frames"]), f"{spec['plan']}: {got['compiled_frames']}"
    # the reference is the one-process run without compile (check_against_one_process
    # keeps the spec's options, so drop compile from them)
    eager = [{**s, "options": {}} for s in specs]
    check_against_one_process(eager, results)


# torch's zero-bubble runs each stage's backward in two passes, which a compiled block
# refuses (measured: "compiled with non-empty donated buffers"): refused before training.
ZERO_BUBBLE = make_spec("gpt4", "pp=2,schedule=zero-bubble,microbatches=4", options=COMPILE)


def compile_runs(specs: list[dict]) -> list[dict]:
    return runs_or_refusals(engine_run, specs)


def test_wrapped_block_forwards_follow_a_deep_copy_and_pickle() -> None:
    """Recomputed and compiled blocks keep their forward as a method of the block, so a
    copy of the model runs its own weights (a closure would run the original's)."""
    import copy
    import pickle

    from workers import build

    from meshfit.parallel.compiled import compile_block_forwards
    from meshfit.parallel.recompute import apply_recomputation

    recomputed = build("gpt")[0]
    apply_recomputation(recomputed, "full")
    copied = copy.deepcopy(recomputed)
    with torch.no_grad():
        for p in copied.blocks.parameters():
            p.zero_()
    tokens = torch.randint(0, 32, (2, 8))
    # a copy whose blocks ran the original's weights would give the original's output
    assert not torch.allclose(copied(tokens), recomputed(tokens))
    # compiled too (checked without running: no compiling in the everyday tier)
    compile_block_forwards(list(recomputed.blocks))
    # pickle.loads reads the bytes pickle.dumps made on the line itself: nobody else's
    for again in (copy.deepcopy(recomputed), pickle.loads(pickle.dumps(recomputed))):
        assert all(b.forward.__self__ is b for b in again.blocks)


@pytest.mark.slow
def test_compile_under_every_two_process_plan_matches_one_eager_process() -> None:
    pytest.importorskip("transformers")
    *results, refused = mf.launch(compile_runs, nproc=2, args=([*TWO_PROCESS, ZERO_BUBBLE],))
    _check(TWO_PROCESS, results)
    assert "compile=True does not combine with schedule='zero-bubble'" in refused["refused"]


@pytest.mark.slow
def test_compile_under_two_dimensional_plans_matches_one_eager_process() -> None:
    _check(FOUR_PROCESS, mf.launch(many_engine_runs, nproc=4, args=(FOUR_PROCESS,)))
