"""Time of `mf.launch` of a function that returns 1, cold (workers spawned as fresh
interpreters, MESHFIT_WARM_START=0) and warm (forked from the server that has imported
torch and meshfit: launch/warm.py), for 2, 4 and 8 workers. Each measurement runs in a
fresh Python process, so the first warm launch includes starting the server.

    python benchmarks/launch_time.py                       # 3 rounds, medians
    python benchmarks/launch_time.py --rounds 1 --nproc 2  # quick
    python benchmarks/launch_time.py --out benchmarks/results/launch-time-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# What one measuring process runs: `launches` launches in a row, each timed.
MEASURE = """
import json, sys, time
import meshfit as mf

def one():
    return 1

if __name__ == "__main__":
    times = []
    for _ in range(int(sys.argv[2])):
        start = time.perf_counter()
        assert mf.launch(one, nproc=int(sys.argv[1])) == 1
        times.append(time.perf_counter() - start)
    print(json.dumps(times))
"""


def measure(nproc: int, warm: bool, launches: int) -> list[float]:
    env = dict(os.environ, MESHFIT_WARM_START="1" if warm else "0")
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(nproc), str(launches)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--launches", type=int, default=4, help="launches per process")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print("| workers | cold launch (s) | warm: first launch (s) | warm: later launches (s) |")
    print("|---|---|---|---|")
    for nproc in args.nproc:
        cold, first, later = [], [], []
        for _ in range(args.rounds):
            cold += measure(nproc, False, args.launches)
            times = measure(nproc, True, args.launches)
            first.append(times[0])
            later += times[1:]
        row = {
            "nproc": nproc,
            "cold_s": statistics.median(cold),
            "warm_first_s": statistics.median(first),
            "warm_s": statistics.median(later),
            "rounds": args.rounds,
            "launches_per_process": args.launches,
        }
        rows.append(row)
        print(
            f"| {nproc} | {row['cold_s']:.2f} | {row['warm_first_s']:.2f} | {row['warm_s']:.2f} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
