"""mf.launch: results, errors with ranks, dying workers, no hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from workers import die_on_rank, launch_facts, raise_on_rank, world_info

import meshfit as mf


def test_launch_returns_rank0_result_and_sets_up_workers() -> None:
    info = mf.launch(world_info, nproc=2)
    assert info == {"rank": 0, "world": 2, "threads": 1}


def test_worker_exception_is_reraised_with_its_type_and_rank() -> None:
    with pytest.raises(KeyError, match="boom on 1") as caught:
        mf.launch(raise_on_rank, nproc=2, args=(1,))
    assert caught.value.rank == 1
    assert any("rank 1" in note for note in caught.value.__notes__)


def test_a_script_without_the_main_guard_gets_one_line_with_the_fix(tmp_path) -> None:
    """Workers import the launching script (spawn); one that calls mf.launch at import
    time printed torch's bootstrapping traceback from every worker."""
    script = tmp_path / "unguarded.py"
    script.write_text("import meshfit as mf\n\ndef f():\n    return 1\n\nmf.launch(f, nproc=2)\n")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 1
    line = f"meshfit.errors.MeshfitError: mf.launch ran while its workers imported {script}: "
    assert line in result.stderr, result.stderr
    assert 'Put the call under `if __name__ == "__main__":`' in result.stderr
    assert "bootstrapping" not in result.stderr


def test_warm_launches_start_workers_as_fresh_as_spawned_ones(tmp_path, monkeypatch, capfd):
    """Workers forked from the warm server (launch/warm.py) start as spawned ones do:
    this process's environment and working directory at each launch (not the server's,
    which started with the first), its stdout, fresh random states (torch's, numpy's and
    Python's differ on every worker and launch, as in spawned ones), no process group,
    meshfit's module state as imported (what a worker left behind is gone), no CUDA;
    and the libraries this process imported are already imported in the worker."""
    pytest.importorskip("transformers")  # imported here: the server imports it too

    from meshfit.launch import warm

    monkeypatch.setenv("MESHFIT_TEST_GONE", "set before the first launch")
    first = mf.launch(launch_facts, nproc=2, args=("first",))
    monkeypatch.delenv("MESHFIT_TEST_GONE")
    monkeypatch.setenv("MESHFIT_TEST_MARK", "set between the launches")
    monkeypatch.chdir(tmp_path)
    time.sleep(2)  # the server is older than the second launch by this much at least
    started = time.monotonic()
    second = mf.launch(launch_facts, nproc=2, args=("second",))
    took = time.monotonic() - started
    # the watchdog's clock starts with the worker, not with the server's imports (a
    # server older than the hang timeout made every new worker's start-up look stalled)
    for facts in second:
        assert facts["phase"] == "setup" and facts["setup_for"] < took, (facts, took)
    for facts in [*first, *second]:
        assert not facts["group_at_start"] and facts["left_behind"] is None, facts
        assert not facts["cuda_initialized"] and facts["preloaded"], facts
    assert [f["gone"] for f in first] == ["set before the first launch"] * 2
    assert [(f["gone"], f["env"]) for f in second] == [(None, "set between the launches")] * 2
    assert {f["cwd"] for f in second} == {str(tmp_path)}
    assert len({f["pid"] for f in [*first, *second]}) == 4
    assert len({f["server"] for f in [*first, *second]}) == 1  # forked by one server
    for source in ("torch_seed", "torch_rand", "numpy", "random"):  # fresh, as spawned
        assert len({f[source] for f in [*first, *second]}) == 4, source
    out = capfd.readouterr().out
    assert out.count("writes to the launch's stdout") == 4, out
    assert warm.enabled()


def test_warm_starts_can_be_turned_off(monkeypatch) -> None:
    """MESHFIT_WARM_START=0: workers spawned fresh, each its own interpreter (not forked
    by the server)."""
    monkeypatch.setenv("MESHFIT_WARM_START", "0")
    facts = mf.launch(launch_facts, nproc=2, args=("spawned",))
    assert not any(f["preloaded"] for f in facts)  # each imported only what it needed
    assert facts[0]["server"] == facts[1]["server"] == os.getpid()  # the agent's children


def test_dead_worker_is_reported_not_waited_for() -> None:
    # one line naming the rank, the signal and its usual cause, not torch's failure dump
    with pytest.raises(mf.WorkerError) as caught:
        mf.launch(die_on_rank, nproc=2, args=(1,))
    line = str(caught.value)
    assert line.startswith(
        "worker rank 1 was killed by signal 9 (SIGKILL): the kernel's out-of-memory killer"
    ), line
    assert "\n" not in line and caught.value.rank == 1


STDIN_SCRIPT = """
import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshfit as mf

OFFSET = 10  # a global of a __main__ that has no file: workers cannot import it


class Doubler(torch.nn.Module):  # a class of that __main__ too
    def forward(self, x):
        return 2 * x


def work(scale):
    mf.parallelize(torch.nn.Linear(1, 1), "dp=2", loss_fn=F.mse_loss)  # joins the group
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {"sum": total.item() * scale + OFFSET, "double": Doubler()(torch.ones(1)).item()}


if __name__ == "__main__":
    print("RESULT", mf.launch(work, nproc=2, args=(3,)))
    print("LAMBDA", mf.launch(lambda: OFFSET + 1, nproc=2))
"""


@pytest.mark.slow
def test_a_function_of_a_main_without_a_file_runs_on_workers() -> None:
    # `python -` (stdin), like a notebook cell or python -c: spawned workers can neither
    # import __main__.work nor run "<stdin>" again; it is sent by value (cloudpickle)
    import os
    import subprocess
    import sys

    pytest.importorskip("cloudpickle")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_SCRIPT,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT {'sum': 19.0, 'double': 2.0}" in done.stdout  # (1 + 2) * 3 + 10
    assert "LAMBDA 11" in done.stdout


def test_only_functions_workers_cannot_import_go_by_value() -> None:
    from meshfit.launch import sends_by_value

    assert not sends_by_value(world_info)  # tests/workers.py: imported by name
    assert sends_by_value(lambda: 0)

    def nested() -> None: ...

    assert sends_by_value(nested)


def test_a_process_srun_started_several_times_over_is_refused(monkeypatch) -> None:
    # srun -n 4 python train.py: four separate trainings writing the same checkpoints
    import torch.nn.functional as F

    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pytest.raises(mf.MeshfitError, match=r"task 1 of 4 that srun \(SLURM\) started"):
        mf.parallelize(torch.nn.Linear(2, 2), None, loss_fn=F.mse_loss)
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: a plain run
    mf.parallelize(torch.nn.Linear(2, 2), None, loss_fn=F.mse_loss)
