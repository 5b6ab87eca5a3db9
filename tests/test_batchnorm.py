"""BatchNorm keeps the promise: statistics over the whole global batch under dp, fsdp
and pp (SyncBatchNorm semantics, on gloo CPU workers), running statistics included;
micro-batches, which BatchNorm would normalise one by one, are refused with the fix."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_run, check_against_one_process, make_spec
from workers import build, engine_run, many_engine_runs

import meshfit as mf


def test_batchnorm_matches_one_process_under_dp_fsdp_and_pp() -> None:
    specs = [
        make_spec("bn_cnn", "dp=2"),
        make_spec("bn_cnn", "fsdp=2"),
        # one micro-batch: GPipe (1F1B needs one per stage at least)
        make_spec("bn_cnn", "pp=2,microbatches=1,schedule=gpipe"),
        make_spec("bn_cnn", "pp=2"),  # the same, chosen by meshfit (a start-up line says so)
    ]
    # Negative control in the same launch: each rank normalising its own half-batch.
    control = make_spec("bn_cnn", "dp=2", options={"sync_batchnorm": False})
    results = mf.launch(many_engine_runs, nproc=2, args=([*specs, control],))
    # check_against_one_process also compares the evaluation loss, which uses the
    # running statistics: they too must be the one-process ones.
    check_against_one_process(specs, results[: len(specs)])
    with pytest.raises(AssertionError):
        assert_same_run(results[-1], engine_run({**control, "plan": None}), 1e-6)


@pytest.mark.slow
def test_pipeline_running_statistics_come_from_their_owner_stage(tmp_path) -> None:
    """Under pp every stage runs the layers before the blocks (its prologue), the later
    ones on stand-in weights: a ResNet's stem BatchNorm had running statistics on every
    stage, and the gathered state and the checkpoint took the last stage's (zeros). And
    the forward that counts the blocks' FLOPs for the cut must not update statistics
    (bn_cnn's counted one batch more than one process). With the example batch fit
    gives, the gathered state, running statistics included, is the one-process state,
    and so is the checkpoint loaded in one process."""
    from zoo import FAMILIES, many_zoo_runs, zoo_optimizer, zoo_run

    plan = "pp=2,microbatches=1,schedule=gpipe"
    specs = [
        {"model": "resnet", "plan": plan, "save": str(tmp_path / "resnet")},
        {"model": "bn_cnn", "plan": plan},
    ]
    results = mf.launch(many_zoo_runs, nproc=2, args=(specs,))
    for spec, got in zip(specs, results, strict=True):
        ref = zoo_run({**spec, "plan": None, "save": None})
        assert_same_run(got, ref)  # every state key: weights and running statistics
    ref_state = zoo_run({"model": "resnet", "plan": None})["state"]
    family = FAMILIES["resnet"]
    engine = mf.parallelize(
        family.build().double(), None, loss_fn=family.loss(), optimizer=zoo_optimizer
    )
    engine.load(str(tmp_path / "resnet"))
    loaded = engine.user_model.state_dict()
    assert ref_state["stem.1.running_mean"].abs().sum() > 0  # the one-process statistics
    for name in ("stem.1.running_mean", "stem.1.running_var", "layers.0.bn1.running_mean"):
        assert torch.allclose(loaded[name], ref_state[name], rtol=1e-12, atol=0), name


def test_batchnorm_with_micro_batches_is_refused_with_the_fix() -> None:
    model, loss_fn = build("bn_cnn")
    with pytest.raises(
        mf.MeshfitError,
        match=r"^layer '1' is a BatchNorm2d .*microbatches=1, or sync_batchnorm=False",
    ):
        mf.parallelize(model, "microbatches=2", loss_fn=loss_fn)
    # The opt-out trains, with each micro-batch normalised on its own.
    engine = mf.parallelize(
        build("bn_cnn")[0], "microbatches=2", loss_fn=loss_fn, sync_batchnorm=False
    )
    assert engine.step(engine_batch()) > 0


def test_batchnorm_under_pp_is_refused_with_the_whole_fix_in_one_line() -> None:
    """Under pp the fix is one micro-batch and the schedule that runs one: naming only
    microbatches=1 led to a second refusal (1f1b needs pp micro-batches)."""
    from meshfit.parallel.batchnorm import refuse_microbatches

    model, _ = build("bn_cnn")
    with pytest.raises(mf.MeshfitError) as refused:
        refuse_microbatches(model, mf.Plan(pp=2).num_microbatches, pp=2)
    fix = "microbatches=1,schedule='gpipe'"
    assert fix in str(refused.value) and "\n" not in str(refused.value)
    mf.Plan.parse("pp=2," + fix.replace("'", "")).validate()  # the fix as given runs


def test_a_pipeline_plan_that_leaves_micro_batches_open_gets_one_for_batchnorm() -> None:
    """pp=2 as written on a BatchNorm model: one micro-batch under GPipe, with the line
    that says why; a plan that sets micro-batches or the schedule is the user's (and is
    refused if it cuts the batch), as is sync_batchnorm=False; no BatchNorm, no change."""
    from meshfit.options import EngineOptions
    from meshfit.prepare import one_microbatch_for_batchnorm

    model, loss_fn = build("bn_cnn")
    options = EngineOptions(loss_fn=loss_fn)
    plan, note = one_microbatch_for_batchnorm(model, mf.Plan(pp=2), options)
    assert (plan.microbatches, plan.schedule) == (1, "gpipe")
    assert "layer '1' is a BatchNorm2d" in note and "\n" not in note
    for kept in (mf.Plan(pp=2, microbatches=4), mf.Plan(pp=2, schedule="interleaved-1f1b")):
        assert one_microbatch_for_batchnorm(model, kept, options) == (kept, None)
    off = EngineOptions(loss_fn=loss_fn, sync_batchnorm=False)
    assert one_microbatch_for_batchnorm(model, mf.Plan(pp=2), off) == (mf.Plan(pp=2), None)
    mlp = build("mlp")[0]
    assert one_microbatch_for_batchnorm(mlp, mf.Plan(pp=2), options) == (mf.Plan(pp=2), None)


def engine_batch():
    from workers import make_batch

    return make_batch("bn_cnn", 8, 0)
