"""mf.launch: results, errors with ranks, dying workers, no hangs."""

from __future__ import annotations

import pytest
import torch
from workers import die_on_rank, raise_on_rank, world_info

import meshfit as mf


def test_launch_returns_rank0_result_and_sets_up_workers() -> None:
    info = mf.launch(world_info, nproc=2)
    assert info == {"rank": 0, "world": 2, "threads": 1}


def test_worker_exception_is_reraised_with_its_type_and_rank() -> None:
    with pytest.raises(KeyError, match="boom on 1") as caught:
        mf.launch(raise_on_rank, nproc=2, args=(1,))
    assert caught.value.rank == 1
    assert any("rank 1" in note for note in caught.value.__notes__)


def test_dead_worker_is_reported_not_waited_for() -> None:
    with pytest.raises(mf.WorkerError, match="died"):
        mf.launch(die_on_rank, nproc=2, args=(1,))


def test_interactive_functions_are_refused_up_front() -> None:
    import sys
    import types

    main = types.ModuleType("__main__")  # a REPL / notebook __main__ has no __file__
    fn = lambda: 0  # noqa: E731
    fn.__module__ = "__main__"
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        with pytest.raises(mf.MeshfitError, match="move it into a .py module"):
            mf.launch(fn, nproc=2)
    finally:
        sys.modules["__main__"] = saved


def test_a_process_srun_started_several_times_over_is_refused(monkeypatch) -> None:
    # srun -n 4 python train.py: four separate trainings writing the same checkpoints
    import torch.nn.functional as F

    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pytest.raises(mf.MeshfitError, match=r"task 1 of 4 that srun \(SLURM\) started"):
        mf.parallelize(torch.nn.Linear(2, 2), None, loss_fn=F.mse_loss)
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: a plain run
    mf.parallelize(torch.nn.Linear(2, 2), None, loss_fn=F.mse_loss)
