"""A few trials of the fault campaign (benchmarks/faults.py) on every full run: a rank
killed mid-save, a rank stopped in training (a hang) and a corrupted checkpoint, under
pp=2 with AdamW; each must end with bit-identical weights. A stop before a rank's first
heartbeat is named by tests/test_watchdog.py (a stop there waits out the watchdog's 60 s
start-up floor: this test took 74-148 s in CI, by the draw, when its stop could land
there). The whole campaign's table is in BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.alone  # a false hang verdict on busy cores ends a trial (below)
def test_fault_campaign_trials_end_exact(tmp_path) -> None:
    """On a loaded machine every run is slower, so: each run may take max(240 s, 4x the
    undisturbed run) (faults.py's --limit and --limit-factor), a run cut short by that
    limit while still computing is reported as TIMEOUT (the machine, not meshfit), and
    the hang timeout is 15 s (a first save or step has no earlier one to scale its
    allowance by, so 5 s was all a live rank got on two busy cores; a false hang
    verdict costs a restart and can be the meshfit line the stop trial reads)."""
    out = tmp_path / "faults.json"
    argv = [sys.executable, os.path.join(ROOT, "benchmarks", "faults.py"), "--plans", "pp=2"]
    argv += ["--faults", "kill-save", "stop", "corrupt", "--trials", "1"]
    argv += ["--hang-timeout", "15", "--limit", "240", "--limit-factor", "4"]
    argv += ["--stop-when", "training"]  # a stop in start-up waits 60 s (tested in units)
    argv += ["--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    trials = json.loads(out.read_text())
    assert [t["fault"] for t in trials] == ["kill-save", "stop", "corrupt"], done.stdout
    slow = [t for t in trials if t["outcome"] == "TIMEOUT"]
    assert not slow, f"timed out (machine too busy for the limit): {slow}\n{done.stdout}"
    assert all(t["outcome"] == "exact" for t in trials), done.stdout + done.stderr[-3000:]
    assert all(t["rank"] is not None for t in trials), (
        "a fault came after the run ended\n" + done.stdout
    )
    stop = trials[1]
    assert f"hang detected: rank {stop['rank']} stopped responding" in stop["detail"], stop
    assert done.returncode == 0
