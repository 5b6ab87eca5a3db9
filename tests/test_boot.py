"""meshfit/launch/boot.py, which every `meshfit run` worker starts with: the user's script runs
as `python script.py` would run it, everything of Python's own exit runs (the user's
atexit handlers, open files flushed), and then the process ends without the
interpreter's teardown, where a gloo thread can abort a finished worker (launch/boot.py says
why). Run here as the workers run it, without torch (no process group needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from meshfit.launch.run_command import BOOT

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import neighbour  # next to the script: sys.path[0] is the script's directory
    if "torch" in sys.argv:  # objects that warn when their __class__ is read
        import torch.distributed

    class Teardown:
        def __del__(self):
            print("teardown ran", flush=True)

    kept = Teardown()  # freed only by the interpreter's teardown
    log = open(sys.argv[1], "w")  # never closed: only a flush at exit keeps its text
    log.write(f"{neighbour.NAME} {__name__} {sys.argv[2:]}")
    atexit.register(lambda: print("user atexit ran", flush=True))
    if "fail" in sys.argv:
        raise ValueError("boom")
    if "code" in sys.argv:
        sys.exit(3)
    if "text" in sys.argv:
        sys.exit("stopped: a reason")
    """
)


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "job").mkdir(exist_ok=True)
    (tmp_path / "job" / "train.py").write_text(SCRIPT)
    (tmp_path / "job" / "neighbour.py").write_text("NAME = 'neighbour'\n")
    return subprocess.run(
        [sys.executable, "-u", BOOT, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_a_script_runs_as_python_runs_it_and_exits_past_teardown(tmp_path) -> None:
    log = tmp_path / "log.txt"
    done = _run(tmp_path, "job/train.py", str(log), "a", "torch")
    assert done.returncode == 0, done.stderr
    assert log.read_text() == "neighbour __main__ ['a', 'torch']"  # flushed, argv as given
    assert done.stdout.splitlines() == ["user atexit ran"]  # and no "teardown ran"
    assert done.stderr == ""  # nothing said while looking for files to flush
    # control: the same script run plainly does go through teardown
    plain = subprocess.run(
        [sys.executable, "job/train.py", str(log)], capture_output=True, text=True, cwd=tmp_path
    )
    assert plain.stdout.splitlines() == ["user atexit ran", "teardown ran"], plain.stderr


def test_exit_statuses_and_tracebacks_are_the_scripts_own(tmp_path) -> None:
    log = str(tmp_path / "log.txt")
    failed = _run(tmp_path, "job/train.py", log, "fail")
    assert failed.returncode == 1
    frames = [line for line in failed.stderr.splitlines() if line.startswith("  File ")]
    assert len(frames) == 1 and "train.py" in frames[0], failed.stderr  # no boot.py/runpy
    assert failed.stderr.rstrip().endswith("ValueError: boom")
    assert "user atexit ran" in failed.stdout  # exit handlers still run after an error
    assert _run(tmp_path, "job/train.py", log, "code").returncode == 3
    text = _run(tmp_path, "job/train.py", log, "text")
    assert (text.returncode, text.stderr.strip()) == (1, "stopped: a reason")


def test_a_module_runs_as_python_m_runs_it(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import sys\nprint(__name__, sys.argv[1:], flush=True)\n")
    done = _run(tmp_path, "--meshfit-module", "pkg.train", "x")
    assert (done.returncode, done.stdout, done.stderr) == (0, "__main__ ['x']\n", "")
    assert os.path.isfile(BOOT)
