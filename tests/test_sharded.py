"""Sharded data parallel (FSDP2), activation checkpointing and the memory report."""

from __future__ import annotations

import pytest
from helpers import assert_same_run, check_against_one_process, make_spec
from workers import (
    activation_costs,
    build,
    continue_run,
    engine_run,
    fsdp_checks,
    make_batch,
    many_engine_runs,
    memory_run,
    save_after_training,
)

import meshfit as mf


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp_matches_one_process_with_a_zero3_share_of_the_state(nproc: int) -> None:
    plan = f"fsdp={nproc}"
    specs = [
        make_spec("mlp", plan),
        make_spec("gpt4", plan),
        make_spec("gpt4", plan + ",microbatches=2"),
        make_spec("gpt4", plan, optimizer="adamw", grad_clip=0.05),
    ]
    if nproc == 2:  # the options, and replicas on FSDP2 (offload on CPU workers is a no-op)
        specs += [
            make_spec("gpt4", "fsdp=2,reshard_after_forward=false,microbatches=2"),
            make_spec("gpt4", "dp=2,offload=true", optimizer="adamw"),
        ]
    got = mf.launch(fsdp_checks, nproc=nproc, args=(specs, plan))
    check_against_one_process(specs, got["runs"])
    # gradient accumulation: each FSDP unit reduce-scatters once per step, after the last
    # micro-batch (FSDPGradientSync defers the others'), not once per micro-batch
    accumulated = got["runs"][2]
    assert accumulated["fsdp_units"] >= 3
    assert accumulated["reduce_scatters_last_step"] == accumulated["fsdp_units"], accumulated
    # params, gradients and AdamW state per rank = the whole / N (ZeRO-3), within 5%
    whole = memory_run("dp=1")
    for kind in ("parameters", "gradients", "optimizer"):
        share = got["memory"][kind]
        assert abs(share - whole[kind] / nproc) <= 0.05 * whole[kind] / nproc, (kind, share)
    # After a forward, ZeRO-3 frees the blocks' gathered parameters but those of the last
    # block and the root, whose backward comes first; reshard_after_forward=False keeps
    # every unit gathered until its backward.
    zero3 = {"first block": False, "last block": True, "root": True}
    assert got["gathered"] == {True: zero3, False: dict.fromkeys(zero3, True)}


def test_offload_in_one_process_runs_on_fsdp2() -> None:
    """One worker: a process group of one, the model sharded 1 way (what puts a GPU run's
    state in CPU memory; on CPU workers the offload itself is a no-op)."""
    specs = [make_spec("gpt4", "offload=true", optimizer="adamw", grad_clip=0.05)]
    got = mf.launch(many_engine_runs, nproc=1, args=(specs,))
    check_against_one_process(specs, got)
    assert got[0]["fsdp_units"] == 1 + len(build("gpt4")[0].blocks)  # each block + root


def test_activation_checkpointing_recomputes_the_same_run_with_less_memory() -> None:
    ref = engine_run(make_spec("gpt4", "dp=1"))
    for mode in ("full", "selective"):
        got = engine_run(make_spec("gpt4", f"checkpointing={mode}"))
        assert_same_run(got, ref)
    costs = {m: activation_costs(f"checkpointing={m}") for m in ("none", "selective", "full")}
    kept = {m: c[0] for m, c in costs.items()}
    matmuls = {m: c[1] for m, c in costs.items()}
    assert kept["full"] < kept["none"] / 4 and kept["selective"] < kept["none"] / 4, kept
    # full recomputes the forward's matrix products in backward; selective keeps them.
    assert matmuls["full"] > matmuls["none"] == matmuls["selective"], matmuls
    # And it composes with the forms that split the model (names, hooks, stages):
    specs = [
        make_spec("gpt4", "fsdp=2,checkpointing=full"),
        make_spec("gpt4", "pp=2,checkpointing=selective"),
        make_spec("gpt4", "tp=2,checkpointing=full"),
    ]
    check_against_one_process(specs, mf.launch(many_engine_runs, nproc=2, args=(specs,)))


def _continues_across_plans(tmp_path, first: str, then: str, *, nproc: int, steps: int) -> None:
    """`steps` steps under `first`, save, load under `then`, `steps` more == 2 * `steps`
    steps in one process (weights, SGD momentum and step count all move across plans)."""
    path = str(tmp_path / "ck")
    mf.launch(save_after_training, nproc=nproc, args=(make_spec("gpt4", first, steps=steps), path))
    got = mf.launch(
        continue_run, nproc=nproc, args=(make_spec("gpt4", then, steps=steps), path, steps)
    )
    straight = engine_run(make_spec("gpt4", "dp=1", steps=2 * steps))
    assert_same_run(got, {"losses": straight["losses"][steps:], "state": straight["state"]})


@pytest.mark.slow
def test_checkpoint_saved_under_fsdp_continues_under_dp(tmp_path) -> None:
    _continues_across_plans(tmp_path, "fsdp=2", "dp=2", nproc=2, steps=3)


def test_fit_reports_memory_per_rank_when_asked() -> None:
    from workers import dataset, optimizer_factory

    model, loss_fn = build("gpt4")
    history = mf.fit(
        model,
        dataset("gpt4", 32),
        loss_fn=loss_fn,
        batch_size=8,
        max_steps=2,
        optimizer=optimizer_factory("adamw"),
        log_every=1,
        progress=False,
        report_memory=True,
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = history.records[-1]["memory"]
    assert memory["parameters"] == params and memory["gradients"] == params
    assert memory["optimizer"] == 2 * params  # AdamW: two moments per parameter


@pytest.mark.slow
def test_two_dimensional_plans_match_one_process() -> None:
    specs = [
        make_spec("gpt4", "fsdp=2,tp=2", optimizer="adamw", grad_clip=0.05),
        make_spec("gpt4", "dp=2,tp=2", optimizer="adamw", grad_clip=0.05),
        make_spec("gpt4", "dp=2,fsdp=2", optimizer="adamw", grad_clip=0.05),
        make_spec("gpt4", "tp=2,pp=2", optimizer="adamw", grad_clip=0.05),
        # an example batch: the cut is timed by rank 0's tp group together (as fit does)
        make_spec("gpt4", "tp=2,pp=2", options={"example_inputs": make_batch("gpt4", 4, 0)[0]}),
        make_spec("gpt4", "dp=2,pp=2"),
        # DDP per stage crashed in its second step with GPipe or microbatches == pp
        make_spec("gpt4", "dp=2,pp=2,schedule=gpipe,microbatches=2"),
        # one micro-batch: each block reduces after its own backward (not deferred)
        make_spec("gpt4", "fsdp=2,pp=2,schedule=gpipe,microbatches=1", optimizer="adamw"),
        make_spec("gpt4", "fsdp=2,pp=2,schedule=gpipe", optimizer="adamw", grad_clip=0.05),
    ]
    results = mf.launch(many_engine_runs, nproc=4, args=(specs,))
    check_against_one_process(specs, results)
    # fsdp x pp: each FSDP unit reduce-scatters once per step, after the last of the 4
    # micro-batches (it did in every micro-batch's backward: 4x the traffic)
    fsdp_pp = results[-1]
    assert (
        fsdp_pp["fsdp_units"] >= 3 and fsdp_pp["reduce_scatters_last_step"] == fsdp_pp["fsdp_units"]
    )


@pytest.mark.slow
def test_three_dimensional_plan_on_eight_workers_matches_one_process() -> None:
    # 3 steps, not 4: 8 processes on the 2-core CI machine make each step slow
    specs = [
        make_spec("gpt4", "fsdp=2,tp=2,pp=2", optimizer="adamw", grad_clip=0.05, steps=3),
        make_spec("gpt4", "dp=2,tp=2,pp=2", steps=3),
    ]
    check_against_one_process(specs, mf.launch(many_engine_runs, nproc=8, args=(specs,)))


@pytest.mark.slow
def test_checkpoint_saved_under_dp4_continues_under_tp2_pp2(tmp_path) -> None:
    _continues_across_plans(tmp_path, "dp=4", "tp=2,pp=2", nproc=4, steps=2)
