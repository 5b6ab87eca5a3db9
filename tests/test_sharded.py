"""Sharded data parallel (FSDP2), activation checkpointing and the memory report."""

from __future__ import annotations

import pytest
from helpers import assert_same_run, relative_error
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

BATCH = 16
STEPS = 4


def _spec(model: str, plan: str, **extra) -> dict:
    return {"model": model, "plan": plan, "batch": BATCH, "steps": STEPS, **extra}


def _check(specs: list[dict], results: list[dict]) -> None:
    for spec, got in zip(specs, results, strict=True):
        ref = engine_run({**spec, "plan": None})
        assert_same_run(got, ref)
        assert abs(got["eval"] - ref["eval"]) <= 1e-5 * abs(ref["eval"]), spec
        initial = build(spec["model"])[0].state_dict()  # the run really trained
        assert max(relative_error(ref["state"][k], initial[k]) for k in initial) > 1e-2


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_matches_one_process_with_a_zero3_share_of_the_state(nproc: int) -> None:
    plan = f"fsdp={nproc}"
    specs = [
        _spec("mlp", plan),
        _spec("gpt4", plan),
        _spec("gpt4", plan + ",microbatches=2"),
        _spec("gpt4", plan, optimizer="adamw", grad_clip=0.05),
    ]
    if nproc == 2:  # the options, and replicas on FSDP2 (offload on CPU workers is a no-op)
        specs += [_spec("gpt4", "fsdp=2,reshard_after_forward=false,microbatches=2"),
                  _spec("gpt4", "dp=2,offload=true", optimizer="adamw")]  # fmt: skip
    got = mf.launch(fsdp_checks, nproc=nproc, args=(specs, plan))
    _check(specs, got["runs"])
    # params, gradients and AdamW state per rank = the whole / N (ZeRO-3), within 5%
    whole = memory_run("dp=1")
    for kind in ("parameters", "gradients", "optimizer"):
        share = got["memory"][kind]
        assert abs(share - whole[kind] / nproc) <= 0.05 * whole[kind] / nproc, (kind, share)
    # reshard_after_forward=False keeps a block's parameters gathered until its backward
    assert got["gathered"] == {True: False, False: True}


def test_offload_in_one_process_runs_on_fsdp2() -> None:
    """One worker: a process group of one, the model sharded 1 way (what puts a GPU run's
    state in CPU memory; on CPU workers the offload itself is a no-op)."""
    specs = [_spec("gpt4", "offload=true", optimizer="adamw", grad_clip=0.05)]
    got = mf.launch(many_engine_runs, nproc=1, args=(specs,))
    _check(specs, got)
    assert got[0]["fsdp_units"] == 1 + len(build("gpt4")[0].blocks)  # each block + root


def test_activation_checkpointing_recomputes_the_same_run_with_less_memory() -> None:
    ref = engine_run(_spec("gpt4", "dp=1"))
    for mode in ("full", "selective"):
        got = engine_run(_spec("gpt4", f"checkpointing={mode}"))
        assert_same_run(got, ref)
    costs = {m: activation_costs(f"checkpointing={m}") for m in ("none", "selective", "full")}
    kept = {m: c[0] for m, c in costs.items()}
    matmuls = {m: c[1] for m, c in costs.items()}
    assert kept["full"] < kept["none"] / 4 and kept["selective"] < kept["none"] / 4, kept
    # full recomputes the forward's matrix products in backward; selective keeps them.
    assert matmuls["full"] > matmuls["none"] == matmuls["selective"], matmuls
    # And it composes with the forms that split the model (names, hooks, stages):
    specs = [_spec("gpt4", "fsdp=2,checkpointing=full"), _spec("gpt4", "pp=2,checkpointing=selective"),
             _spec("gpt4", "tp=2,checkpointing=full")]  # fmt: skip
    _check(specs, mf.launch(many_engine_runs, nproc=2, args=(specs,)))


def test_checkpoint_saved_under_fsdp_continues_under_dp(tmp_path) -> None:
    """fsdp=2 for 3 steps, save, load under dp=2, 3 more steps == 6 steps in one process
    (weights, SGD momentum and step count all move across the plans)."""
    path = str(tmp_path / "ck")
    mf.launch(save_after_training, nproc=2, args=(_spec("gpt4", "fsdp=2", steps=3), path))
    got = mf.launch(continue_run, nproc=2, args=(_spec("gpt4", "dp=2", steps=3), path, 3))
    straight = engine_run(_spec("gpt4", "dp=1", steps=6))
    assert_same_run({"losses": got["losses"], "state": got["state"]},
                    {"losses": straight["losses"][3:], "state": straight["state"]})  # fmt: skip


def test_fit_reports_memory_per_rank_when_asked() -> None:
    from workers import dataset, optimizer_factory

    model, loss_fn = build("gpt4")
    history = mf.fit(model, dataset("gpt4", 32), loss_fn=loss_fn, batch_size=8, max_steps=2,
                     optimizer=optimizer_factory("adamw"), log_every=1, progress=False,
                     report_memory=True)  # fmt: skip
    params = sum(p.numel() * 4 for p in model.parameters())
    memory = history.records[-1]["memory"]
    assert memory["parameters"] == params and memory["gradients"] == params
    assert memory["optimizer"] == 2 * params  # AdamW: two moments per parameter


def test_two_dimensional_plans_match_one_process() -> None:
    specs = [
        _spec("gpt4", "fsdp=2,tp=2", optimizer="adamw", grad_clip=0.05),
        _spec("gpt4", "dp=2,tp=2", optimizer="adamw", grad_clip=0.05),
        _spec("gpt4", "dp=2,fsdp=2", optimizer="adamw", grad_clip=0.05),
        _spec("gpt4", "tp=2,pp=2", optimizer="adamw", grad_clip=0.05),
        # an example batch: the cut is timed by rank 0's tp group together (as fit does)
        _spec("gpt4", "tp=2,pp=2", options={"example_inputs": make_batch("gpt4", 4, 0)[0]}),
        _spec("gpt4", "dp=2,pp=2"),
        _spec("gpt4", "fsdp=2,pp=2,schedule=gpipe", optimizer="adamw", grad_clip=0.05),
    ]
    _check(specs, mf.launch(many_engine_runs, nproc=4, args=(specs,)))


def test_three_dimensional_plan_on_eight_workers_matches_one_process() -> None:
    # 3 steps, not 4: 8 processes on the 2-core CI machine make each step slow
    specs = [_spec("gpt4", "fsdp=2,tp=2,pp=2", optimizer="adamw", grad_clip=0.05, steps=3),
             _spec("gpt4", "dp=2,tp=2,pp=2", steps=3)]  # fmt: skip
    _check(specs, mf.launch(many_engine_runs, nproc=8, args=(specs,)))


def test_checkpoint_saved_under_dp4_continues_under_tp2_pp2(tmp_path) -> None:
    path = str(tmp_path / "ck")
    mf.launch(save_after_training, nproc=4, args=(_spec("gpt4", "dp=4", steps=2), path))
    got = mf.launch(continue_run, nproc=4, args=(_spec("gpt4", "tp=2,pp=2", steps=2), path, 2))
    straight = engine_run(_spec("gpt4", "dp=1", steps=4))
    assert_same_run({"losses": got["losses"], "state": got["state"]},
                    {"losses": straight["losses"][2:], "state": straight["state"]})  # fmt: skip
