"""`meshfit run` under SLURM (issue 13 item 6): the compressed host list, the step's
variables filling --nnodes/--master (what is given wins), the layouts that cannot be one
meshfit run per node refused, and (slow) two "hosts" started as srun would start them,
with no multi-node option, training dp=4 exactly as one process."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch
from helpers import check_against_one_process, make_spec

from meshfit.errors import MeshfitError
from meshfit.launch import IFNAME_ENVS, rendezvous, scheduler
from meshfit.launch.scheduler import expand_hostlist, fill_nodes, read_slurm

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
SECRET = "slurm-secret-0123456789abcdef01234"


# ---- the host list ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu5", ["gpu5"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),  # no padding: widths follow the first number
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),  # several groups multiply out
        ("rack1-[2-3]-x,a.b.c", ["rack1-2-x", "rack1-3-x", "a.b.c"]),
        ("10.232.0.[1-2]", ["10.232.0.1", "10.232.0.2"]),  # addresses are legal names
        (" a , b ", ["a", "b"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("node[01-03", "unbalanced"),
        ("node01-03]", "unbalanced"),
        ("node[[1]]", "unbalanced"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "expected numbers"),
        ("node[]", "expected numbers"),
        ("a,,b", "empty name"),
        ("", "empty name"),
    ],
)
def test_bad_host_lists_are_refused_naming_the_list(text: str, error: str) -> None:
    with pytest.raises(MeshfitError, match=error):
        expand_hostlist(text)


# ---- the step's variables --------------------------------------------------------------


@pytest.fixture(autouse=True)
def unresolved_names(monkeypatch) -> None:
    """The made-up host names (node01, gpu07) resolve nowhere, at once (no DNS wait)."""
    real = scheduler.addresses_of
    monkeypatch.setattr(
        scheduler, "addresses_of", lambda host: real(host) if host[0].isdigit() else []
    )


def srun_env(node_id: int, nodes: str = "node[01-02]", nnodes: int = 2, **more: str) -> dict:
    """What `srun --ntasks-per-node=1` gives the task on node `node_id` of a job."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": str(nnodes),
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_NODELIST": nodes,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_NUM_TASKS": str(nnodes),
        "SLURM_STEP_TASKS_PER_NODE": f"1(x{nnodes})",
        "SLURM_NTASKS": str(nnodes),
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id),
        "SLURM_LOCALID": "0",
        **more,
    }


def test_a_step_gives_nodes_master_and_a_port_from_the_job_id() -> None:
    slurm = read_slurm(srun_env(1))
    assert (slurm.nnodes, slurm.hosts, slurm.node_id) == (2, ("node01", "node02"), 1)
    assert slurm.port == 20000 + 4242
    filled = fill_nodes(None, None, srun_env(1))
    assert (filled.nnodes, filled.master) == (2, "node01:24242")
    assert filled.line == (
        "meshfit: from SLURM: --nnodes 2 (SLURM_STEP_NUM_NODES), --master node01:24242 "
        "(first host of SLURM_STEP_NODELIST, 20000 + SLURM_JOB_ID % 10000); this is node 1 "
        "of 2 (SLURM_NODEID)"
    )


def test_the_step_wins_over_the_job_and_the_job_variables_alone_do() -> None:
    # srun -N2 inside a 4-node allocation: the step's two nodes are the run
    env = srun_env(0, nodes="b[3-4]", SLURM_JOB_NODELIST="a[1-4]", SLURM_JOB_NUM_NODES="4")
    assert fill_nodes(None, None, env).master == "b3:24242"
    # a step with the job's variables alone (no SLURM_STEP_NUM_NODES/NODELIST): read
    plain = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "x,y"}
    plain["SLURM_STEP_ID"] = "0"
    filled = fill_nodes(None, None, plain)
    assert (filled.nnodes, filled.master) == (2, "x:29500")  # no job id: the default port


def test_options_given_win_over_slurm() -> None:
    env = srun_env(0)
    assert fill_nodes(2, "10.0.0.9:29600", env) == fill_nodes(2, "10.0.0.9:29600", {})
    assert fill_nodes(2, "10.0.0.9:29600", env).line is None
    only_master = fill_nodes(None, "10.0.0.9:29600", env)
    assert (only_master.nnodes, only_master.master) == (2, "10.0.0.9:29600")
    assert "--master" not in (only_master.line or "") and "--nnodes 2" in only_master.line
    assert fill_nodes(1, None, env).master is None  # --nnodes 1: one node, loopback


def test_outside_slurm_and_on_one_node_a_run_is_single_node() -> None:
    assert (fill_nodes(None, None, {}).nnodes, fill_nodes(None, None, {}).line) == (1, None)
    one = fill_nodes(None, None, srun_env(0, nodes="node7", nnodes=1))
    assert (one.nnodes, one.master) == (1, None)  # no rendezvous port, no secret needed


@pytest.mark.parametrize(
    ("env", "error"),
    [
        # srun -N2 -n4: two meshfit runs per node
        (
            srun_env(0, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)"),
            r"srun started 4 tasks on 2 nodes \(2\(x2\) per node\).*--ntasks-per-node=1",
        ),
        (srun_env(0, SLURM_LOCALID="1"), "--ntasks-per-node=1"),
        # srun -n 2 on one node: two single-node runs would train apart
        (srun_env(0, nodes="n1", nnodes=1, SLURM_STEP_NUM_TASKS="2"), "2 tasks on 1 node "),
        # meshfit run in the batch script itself: the first node only
        (
            {k: v for k, v in srun_env(0).items() if not k.startswith("SLURM_STEP")},
            "not started by srun.*srun --ntasks-per-node=1",
        ),
        (srun_env(0, SLURM_STEP_NUM_NODES="3"), "names 2 hosts but SLURM_STEP_NUM_NODES=3"),
        (srun_env(2), "SLURM_NODEID=2 is not below"),
        (srun_env(0, SLURM_STEP_NODELIST="n[1-"), "unbalanced"),
        (srun_env(0, SLURM_STEP_NUM_NODES="two"), "not a whole number"),
    ],
)
def test_layouts_that_are_not_one_run_per_node_are_refused(env: dict, error: str) -> None:
    with pytest.raises(MeshfitError, match=error):
        fill_nodes(None, None, env)


def test_a_first_host_that_resolves_to_loopback_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(scheduler, "addresses_of", lambda host: ["127.0.1.1"])
    with pytest.raises(MeshfitError, match=r"node01, resolves to 127.0.1.1 \(loopback\)"):
        fill_nodes(None, None, srun_env(0))
    assert fill_nodes(None, "10.0.0.1:29500", srun_env(0)).nnodes == 2  # --master given


def test_mpirun_copies_are_refused_with_what_to_give_instead() -> None:
    for env in ({"OMPI_COMM_WORLD_SIZE": "2"}, {"PMI_SIZE": "2", "SLURM_JOB_ID": "1"}):
        with pytest.raises(MeshfitError, match="name no hosts.*--nnodes NODES --master"):
            fill_nodes(None, None, env)
    assert fill_nodes(2, "h:1", {"OMPI_COMM_WORLD_SIZE": "2"}).master == "h:1"  # given
    # srun --mpi=pmi2 sets PMI_SIZE for its tasks: the step's variables are read
    assert fill_nodes(None, None, srun_env(0, PMI_SIZE="2")).nnodes == 2


# ---- meshfit run, as a user calls it ------------------------------------------------


@pytest.fixture
def no_cluster_env(monkeypatch) -> None:
    """This test process may itself run under SLURM or mpirun: start from none of it."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_")):
            monkeypatch.delenv(name)


def _run_options(monkeypatch, capsys, *argv: str):
    """The RunOptions `meshfit run ARGV` would start with (none started), and stdout."""
    from meshfit.cli import main

    launcher = importlib.import_module("meshfit.launch.run_command")
    seen = []
    monkeypatch.setattr(launcher, "run", lambda options: seen.append(options) or 0)
    assert main(["run", *argv]) == 0
    return seen[0], capsys.readouterr().out


def test_meshfit_run_fills_its_options_from_srun(
    no_cluster_env, monkeypatch, capsys, tmp_path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    for name, value in srun_env(1, nodes="gpu[07-08]").items():
        monkeypatch.setenv(name, value)
    options, out = _run_options(monkeypatch, capsys, "--nproc", "2", str(script))
    assert (options.nnodes, options.master, options.node_rank) == (2, "gpu07:24242", None)
    assert "meshfit: from SLURM: --nnodes 2" in out and "this is node 1 of 2" in out
    options, out = _run_options(
        monkeypatch, capsys, "--master", "10.1.1.1:29500", "--nnodes", "2", str(script)
    )
    assert (options.nnodes, options.master) == (2, "10.1.1.1:29500") and out == ""


def test_meshfit_run_refuses_two_tasks_per_node_in_one_line(
    no_cluster_env, monkeypatch, capsys, tmp_path
) -> None:
    from meshfit.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    env = srun_env(0, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use srun --ntasks-per-node=1 meshfit run" in err[0]


def test_meshfit_run_outside_slurm_is_one_node(no_cluster_env, monkeypatch, capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    options, out = _run_options(monkeypatch, capsys, str(script))
    assert (options.nnodes, options.master) == (1, None) and out == ""


# ---- two hosts started as srun starts them -----------------------------------------------


def _host_env(node_id: int, nodelist: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in list(env):
        if name.startswith(("SLURM_", "OMPI_", "PMI_")) or name in IFNAME_ENVS:
            env.pop(name)
    env.pop(rendezvous.SECRET_FILE_ENV, None)
    # The batch script exported the secret; srun hands every task the same environment.
    return {**env, **srun_env(node_id, nodes=nodelist), rendezvous.SECRET_ENV: SECRET}


@pytest.mark.slow
def test_two_hosts_started_by_srun_train_as_one_process(two_hosts, tmp_path) -> None:
    """Each host runs `meshfit run --nproc 2 SCRIPT` with the variables srun gives one
    task per node, and no --nnodes/--node-rank/--master. The host list holds the hosts'
    addresses in SLURM's compressed form (legal, and resolvable without a DNS for the
    namespaces). Both hosts say what SLURM gave them, meet at the first host on the job's
    port, and dp=4 over 2 hosts x 2 workers reproduces one process."""
    cluster = two_hosts
    specs = [make_spec("mlp", "dp=4")]
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    out = tmp_path / "runs.pt"
    script = os.path.join(SCRIPTS, "cluster_runs.py")
    argv = [sys.executable, "-m", "meshfit.cli", "run", "--nproc", "2", script]
    argv += [str(tmp_path / "specs.json"), str(out)]
    first = cluster.hosts[0].addr
    nodelist = first.rsplit(".", 1)[0] + ".[1-2]"  # 10.232.0.[1-2]
    envs = [_host_env(i, nodelist) for i in range(2)]
    results = cluster.run([argv, argv], env=envs, timeout=300)
    assert [r.returncode for r in results] == [0, 0], "\n".join(r.tail() for r in results)
    for node, result in enumerate(results):
        said = [line for line in result.stdout.splitlines() if "from SLURM" in line]
        assert said == [
            f"meshfit: from SLURM: --nnodes 2 (SLURM_STEP_NUM_NODES), --master {first}:24242 "
            f"(first host of SLURM_STEP_NODELIST, 20000 + SLURM_JOB_ID % 10000); this is "
            f"node {node} of 2 (SLURM_NODEID)"
        ], result.stdout[-2000:]
    check_against_one_process(specs, torch.load(out, weights_only=True))
    placed = [json.loads((tmp_path / f"runs.pt.rank{r}.json").read_text()) for r in range(4)]
    assert {p["world"] for p in placed} == {4}
    assert sorted(p["group_rank"] for p in placed) == [0, 0, 1, 1]
