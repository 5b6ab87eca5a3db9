"""How long an elastic run takes to recover from a lost host, phase by phase.

Three hosts (network namespaces on a bridge, tests/cluster.py: needs root and ip) run
`meshfit run --nnodes 2:3 --nproc 1 --max-restarts 2` of tests/scripts/elastic_train.py
(the elastic tests' float64 MLP, dp=3, checkpoints every 2 steps). After step 5 host 2
stops; the benchmark then either kills its processes (`kill`) or takes its link down
(`cut`), and reads the survivors' output as it arrives, stamping each line:

- detection: the failure -> a survivor's one line ("lost a peer", or the hang
  watchdog's "hang detected" when a cut link leaves the collective waiting);
- re-form: -> the new worker process starts (the agents stop the old workers, the
  dynamic rendezvous drops host 2 after its heartbeats stop, waits last_call, and the
  agents start new workers);
- reload: -> fit's "resumed from" line (imports, process group, plan, DCP load);
- first step: -> the first step after the resume.

    python benchmarks/elastic_recovery.py                      # kill and cut, 3 trials each
    python benchmarks/elastic_recovery.py --modes kill --trials 1 --hang-timeout 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
SCRIPT = os.path.join(TESTS, "scripts", "elastic_train.py")
SECRET = "elastic-bench-0123456789abcdef0123"
PORT = 29500
PHASES = ("detection", "re-form", "reload", "first step", "total")


class Lines:
    """A process's stdout and stderr, each line with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._threads = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (proc.stdout, proc.stderr)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, stream) -> None:  # noqa: ANN001 - a text pipe
        for line in stream:
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, words: str, after: float) -> float | None:
        return next((t for t, line in list(self.lines) if t >= after and words in line), None)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=30)


def trial(mode: str, hang_timeout: float) -> dict[str, float]:
    sys.path.insert(0, TESTS)
    from cluster import Cluster

    env = dict(
        os.environ,
        PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
        MESHFIT_RUN_SECRET=SECRET,
        PYTHONUNBUFFERED="1",
        ELASTIC_TIMES="1",
    )
    with tempfile.TemporaryDirectory() as tmp, Cluster(3) as cluster:
        stall = os.path.join(tmp, "stalled")
        argv = [
            sys.executable, "-m", "meshfit.cli", "run", "--nnodes", "2:3", "--nproc", "1",
            "--max-restarts", "2", "--master", f"{cluster.hosts[0].addr}:{PORT}",
            "--hang-timeout", str(hang_timeout), SCRIPT, "--checkpoint-dir",
            os.path.join(tmp, "ck"), "--out", os.path.join(tmp, "out.pt"), "--steps", "10",
            "--stall-at", "5", "--stall-marker", stall,
        ]  # fmt: skip
        procs, readers = [], []
        for host in cluster.hosts:
            host_env = dict(env, ELASTIC_STALL="1") if host.index == 2 else env
            procs.append(cluster.start(host, argv, host_env))
            readers.append(Lines(procs[-1]))
            time.sleep(0.5)
        deadline = time.monotonic() + 300
        while not os.path.exists(stall) and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = time.time()
        if mode == "kill":
            cluster.kill_host(cluster.hosts[2])
        else:
            cluster.cut_link(cluster.hosts[2])
        for proc in procs[:2]:
            proc.wait(timeout=600)
        cluster.kill_host(cluster.hosts[2])
        for reader in readers:
            reader.join()
        survivors = readers[:2]

        def first(words: str, after: float) -> float:
            times = [t for r in survivors if (t := r.first(words, after)) is not None]
            if not times:
                text = "\n".join(line for r in survivors for _, line in r.lines[-40:])
                raise RuntimeError(f"no {words!r} after the failure:\n{text}")
            return min(times)

        detected = min(
            t
            for words in ("lost a peer", "hang detected")
            for r in survivors
            if (t := r.first(words, failed)) is not None
        )
        started = first("elastic-times: start", detected)
        resumed = first("meshfit: resumed from", started)
        stepped = first("elastic-times: step", resumed)
    return {
        "detection": detected - failed,
        "re-form": started - detected,
        "reload": resumed - started,
        "first step": stepped - resumed,
        "total": stepped - failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="kill,cut")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=15.0)
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        runs = [trial(mode, args.hang_timeout) for _ in range(args.trials)]
        for i, run in enumerate(runs):
            print(f"{mode} trial {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in run.items()))
        rows.append((mode, {k: statistics.median(r[k] for r in runs) for k in PHASES}))
    print(f"\nmedian of {args.trials} trials, seconds (hang timeout {args.hang_timeout:g} s)")
    print("| failure | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for mode, row in rows:
        print(f"| {mode} | " + " | ".join(f"{row[k]:.1f}" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
