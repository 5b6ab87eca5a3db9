"""The meshfit command: devices, run (with restarts after a killed worker), demo, and
bad input that ends in one line and a non-zero exit, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")


def meshfit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "meshfit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.alone  # a 2 s hang timeout: no other test beside it
def test_frozen_worker_is_one_hang_line_and_exit_3(tmp_path) -> None:
    # The reporting rank kills the frozen one, and the launcher may see that death first:
    # it must not add "worker rank 1 was killed by signal 9" to the hang line, nor exit 1.
    script = os.path.join(SCRIPTS, "frozen_rank.py")
    result = meshfit("run", "--nproc", "2", "--hang-timeout", "2", script, str(tmp_path))
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("meshfit: ")][1:]
    assert len(errors) == 1 and "hang detected: rank 1 stopped responding" in errors[0], (
        result.stderr[-3000:]
    )
    assert result.returncode == 3


def test_devices_lists_the_cpu() -> None:
    result = meshfit("devices")
    assert result.returncode == 0, result.stderr
    assert "cpu" in result.stdout and "cores" in result.stdout


def test_unknown_device_id_is_one_line_and_exit_2() -> None:
    result = meshfit("run", "--devices", "5", os.path.join(SCRIPTS, "plan_mismatch.py"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("meshfit: error: no GPU with index 5")
    assert "Traceback" not in result.stderr


def test_plan_that_does_not_match_the_world_is_one_line_no_hang() -> None:
    result = meshfit("run", "--nproc", "2", os.path.join(SCRIPTS, "plan_mismatch.py"), timeout=90)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("meshfit: error")]
    assert errors == [
        "meshfit: error: plan dp=4 uses 4 processes but 2 were started; use dp=2, or start 4 "
        "processes (meshfit run --nproc 4)"
    ]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_run_plan_reaches_the_script_and_a_clash_is_one_line() -> None:
    script = os.path.join(SCRIPTS, "plan_from_command.py")
    result = meshfit("run", "--nproc", "2", "--plan", "fsdp=2", script, timeout=90)
    assert result.returncode == 0, result.stderr
    assert "plan: dp=1,fsdp=2" in result.stdout
    # the script's own plan (dp=4) against the command line's
    clash = meshfit(
        "run", "--nproc", "2", "--plan", "dp=2", os.path.join(SCRIPTS, "plan_mismatch.py")
    )
    errors = [line for line in clash.stderr.splitlines() if line.startswith("meshfit: error")]
    assert errors == [
        "meshfit: error: the script asks for plan dp=4 and meshfit run --plan for dp=2; drop "
        "one (plan=None in the script takes the command line's)"
    ], clash.stderr
    bad = meshfit("run", "--plan", "tp=two", script)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_missing_script_is_a_clear_error() -> None:
    result = meshfit("run", "no_such_script.py")
    assert result.returncode == 2
    assert "no script at 'no_such_script.py'" in result.stderr


@pytest.mark.slow
def test_killed_worker_restarts_and_finishes_the_same_run(tmp_path) -> None:
    script = os.path.join(SCRIPTS, "fault_train.py")
    clean = meshfit(
        "run",
        "--nproc",
        "2",
        script,
        "--checkpoint-dir",
        str(tmp_path / "a"),
        "--out",
        str(tmp_path / "a.pt"),
        timeout=180,
    )
    assert clean.returncode == 0, clean.stderr
    faulty = meshfit(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        script,
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--out",
        str(tmp_path / "b.pt"),
        "--kill-at",
        "5",
        timeout=180,
    )
    assert faulty.returncode == 0, faulty.stderr
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a["attempt"] == 0 and b["attempt"] == 1  # the kill really happened
    assert b["losses"] == a["losses"]
    for name, value in a["state"].items():
        assert torch.equal(b["state"][name], value), name


@pytest.mark.parametrize("plan", [None, pytest.param("fsdp=2", marks=pytest.mark.slow)])
def test_demo_runs_and_prints_a_sample(plan: str | None) -> None:
    """The default plan, and one where no rank holds the whole model to sample from."""
    result = meshfit(
        "demo",
        "--steps",
        "4",
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "2",
        "--data-bytes",
        "200000",
        "--sample-bytes",
        "20",
        *(["--plan", plan] if plan else []),
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "A sample from the model" in result.stdout
    assert f"plan {'dp=1,fsdp=2' if plan else 'dp=2'} on 2 CPU worker(s)" in result.stdout


@pytest.mark.slow
def test_two_nodes_on_loopback_train_together(tmp_path) -> None:
    """--nnodes/--node-rank/--master: two single-worker 'nodes' form one dp=2 job."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(SCRIPTS, "fault_train.py")
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshfit.cli",
                "run",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master",
                f"127.0.0.1:{port}",
                script,
                "--checkpoint-dir",
                str(tmp_path / "ck"),
                "--out",
                str(tmp_path / "out.pt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "on each of 2 nodes" in outputs[0][1]
    single = meshfit(
        "run",
        "--nproc",
        "2",
        script,
        "--checkpoint-dir",
        str(tmp_path / "ck2"),
        "--out",
        str(tmp_path / "ref.pt"),
    )
    assert single.returncode == 0, single.stderr
    a = torch.load(tmp_path / "out.pt", weights_only=True)
    b = torch.load(tmp_path / "ref.pt", weights_only=True)
    for name, value in b["state"].items():
        assert torch.equal(a["state"][name], value), name


@pytest.mark.slow
def test_example_runs_under_meshfit_run() -> None:
    example = os.path.join(os.path.dirname(HERE), "examples", "train_dp.py")
    result = meshfit("run", "--nproc", "2", example, "--steps", "20")
    assert result.returncode == 0, result.stderr
    assert "fit: loss" in result.stdout


def _run_options(monkeypatch, *argv: str):
    """The RunOptions `meshfit run ARGV` would start the workers with (none started)."""
    import importlib

    from meshfit.cli import main

    launcher = importlib.import_module("meshfit.launch.run_command")
    seen = []
    monkeypatch.setattr(launcher, "run", lambda options: seen.append(options) or 0)
    assert main(["run", *argv]) == 0
    return seen[0]


def test_run_config_file_with_the_command_line_winning(tmp_path, monkeypatch) -> None:
    (tmp_path / "train.py").write_text("")
    config = tmp_path / "run.toml"
    config.write_text(
        'script = "train.py"\nargs = ["--lr", "3e-4"]\nnproc = 4\nplan = "tp=2"\n'
        'max_restarts = 2\ndevices = [0, 2]\ntorchrun = ["--log-dir", "logs"]\n'
    )
    options = _run_options(monkeypatch, "--config", str(config))
    assert options.target == str(tmp_path / "train.py")  # found beside the file
    assert options.target_args == ("--lr", "3e-4")
    assert (options.nproc, options.plan, options.max_restarts) == (4, "tp=2", 2)
    assert options.devices == "0,2" and options.nnodes == 1
    assert options.torchrun_args == ("--log-dir", "logs")
    # the command line wins, option by option; its script replaces the file's and args
    options = _run_options(
        monkeypatch,
        "--config",
        str(config),
        "--nproc",
        "2",
        "--max-restarts",
        "0",
        "--torchrun",
        "--redirects 3 --tee=1",
        "other.py",
        "--seed",
        "1",
    )
    assert (options.nproc, options.plan, options.max_restarts) == (2, "tp=2", 0)
    assert (options.target, options.target_args) == ("other.py", ("--seed", "1"))
    assert options.torchrun_args == ("--log-dir", "logs", "--redirects", "3", "--tee=1")


@pytest.mark.slow
def test_run_config_and_torchrun_options_refused_with_the_fix(tmp_path) -> None:
    config = tmp_path / "run.toml"
    cases = [
        ('scrpt = "train.py"\n', "unknown key(s) scrpt"),
        ('script = "train.py"\nnproc = "four"\n', "nproc must be a whole number"),
        ("nproc = [\n", "is not valid TOML"),
        ('script = "t.py"\ntorchrun = ["--nproc_per_node", "4"]\n', "use --nproc instead"),
        ('script = "t.py"\ntorchrun = ["--log-dri", "x"]\n', "torchrun has no option --log-dri"),
    ]
    for text, message in cases:
        config.write_text(text)
        result = meshfit("run", "--config", str(config))
        assert result.returncode == 2 and message in result.stderr, (text, result.stderr)
    result = meshfit("run", "--torchrun", "--master-port 1", "x.py")
    assert "torchrun option --master-port is meshfit's to set: use --master" in result.stderr


@pytest.mark.slow
def test_run_config_starts_the_workers_with_torchrun_options_passed(tmp_path) -> None:
    # torchrun's --redirects/--log-dir (passed through) send each worker's stdout to a
    # file; the command line's --plan wins over the file's
    config = tmp_path / "run.toml"
    logs = tmp_path / "logs"
    config.write_text(
        f'script = "{os.path.join(SCRIPTS, "plan_from_command.py")}"\nnproc = 2\n'
        f'plan = "fsdp=2"\ntorchrun = ["--log-dir", "{logs}", "--redirects", "1"]\n'
    )
    result = meshfit("run", "--config", str(config), "--plan", "dp=2", timeout=90)
    assert result.returncode == 0, result.stderr
    assert "plan:" not in result.stdout  # redirected
    rank0 = list(logs.glob("**/attempt_0/0/stdout.log"))
    assert len(rank0) == 1 and "plan: dp=2" in rank0[0].read_text()


@pytest.mark.alone  # the verdict comes from a peer closing within the 3 s grace
def test_a_save_under_a_rank_guard_and_a_raising_rank_are_named(tmp_path) -> None:
    """`meshfit run` of a script that saves under `if engine.rank == 0:`: one meshfit line
    naming the call and the fix (it was gloo's "Connection closed by peer" traceback,
    then "worker rank 0 exited with code 1 without raising an exception", which was
    false). A rank raising its own error is named with it, its traceback kept."""
    script = os.path.join(SCRIPTS, "guarded_save.py")
    guarded = meshfit("run", "--nproc", "2", script, str(tmp_path / "out"), timeout=120)
    assert guarded.returncode == 2, guarded.stderr
    line = guarded.stderr.strip().splitlines()[-1]
    assert line.startswith("meshfit: error: engine.save_model is called by every rank"), line
    assert "rank 1 had ended its script" in line and "if engine.rank == 0:" in line, line
    raised = meshfit("run", "--nproc", "2", script, str(tmp_path / "out"), "raise", timeout=120)
    assert raised.returncode == 1, raised.stderr
    assert "RuntimeError: an error of the script's own" in raised.stderr  # the traceback
    assert raised.stderr.strip().splitlines()[-1] == (
        "meshfit: worker rank 0 raised RuntimeError: an error of the script's own; its "
        "traceback is above"
    ), raised.stderr


def test_a_plan_that_cannot_fill_the_world_is_refused_before_workers_start(tmp_path) -> None:
    """`meshfit run --nproc 2 --plan fsdp=4`: the launcher knows both numbers, so it
    refuses before starting any worker (each worker refused it after starting)."""
    script = os.path.join(SCRIPTS, "guarded_save.py")
    result = meshfit("run", "--nproc", "2", "--plan", "fsdp=4", script, str(tmp_path / "out"))
    assert result.returncode != 0
    assert "--plan fsdp=4 does not fit the 2 worker(s) this run starts" in result.stderr
    assert "starting 2 CPU workers" not in result.stderr + result.stdout


@pytest.mark.slow
def test_the_hugging_face_fine_tune_example_runs_as_written_under_every_form(tmp_path) -> None:
    """The newcomer's path (examples/hf_finetune.py, the guide's first section): a Llama
    built on meta, weights= from a save_pretrained folder, fit with the model's own loss
    on a collator's batches, save_model read back by from_pretrained. Run as written in
    one process and by `meshfit run` under fsdp=2, tp=2 and pp=2: the same losses (float32)
    and the same saved weights."""
    from safetensors.torch import load_file

    from meshfit.verification.run import weight_differences

    example = os.path.join(os.path.dirname(HERE), "examples", "hf_finetune.py")
    weights = str(tmp_path / "pretrained")
    runs = {}
    for plan in (None, "fsdp=2", "tp=2", "pp=2"):
        out = str(tmp_path / (plan or "one"))
        args = [example, "--weights", weights, "--out", out, "--steps", "4"]
        if plan is None:
            result = subprocess.run(
                [sys.executable, *args], capture_output=True, text=True, timeout=300
            )
        else:
            result = meshfit("run", "--nproc", "2", "--plan", plan, *args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        losses = next(x for x in result.stdout.splitlines() if x.startswith("losses: "))
        assert "from_pretrained reads 180,800 parameters" in result.stdout, result.stdout
        runs[plan] = ([float(x) for x in losses.split()[1:]], load_file(f"{out}/model.safetensors"))
    one_losses, one_state = runs.pop(None)
    for plan, (losses, state) in runs.items():
        assert losses == pytest.approx(one_losses, rel=1e-5), plan
        worst = max(weight_differences(state, one_state).values())
        print(f"{plan}: losses {losses[-1]:.6f}, weights {worst:.1e} off one process")
        assert worst < 1e-5, (plan, worst)  # float32: measured 3e-8 to 7e-7


@pytest.mark.slow
def test_sigterm_stops_the_run_in_one_line_naming_the_newest_checkpoint(tmp_path) -> None:
    """A scheduler's preemption (SIGTERM to `meshfit run`) ended in torch's SignalException
    traceback with no word of the last checkpoint: one line, and the checkpoint."""
    import signal
    import time

    script = os.path.join(SCRIPTS, "checkpoint_then_wait.py")
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.Popen(
        [sys.executable, "-m", "meshfit.cli", "run", "--nproc", "2", script, str(tmp_path)],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"done-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and run.poll() is None, run.stderr.read()
        time.sleep(0.2)
    run.send_signal(signal.SIGTERM)
    stderr = run.communicate(timeout=60)[1]
    assert run.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"meshfit: stopped by SIGTERM: every worker was stopped; the newest intact checkpoint "
        f"is {tmp_path / 'step-00000004'} (step 4): run the same command to resume from it"
    ), stderr
