"""Fault campaign: disturb real training runs and check each ends exact or cleanly refused.

For every plan, one undisturbed run of benchmarks/fault_train.py (mf.fit, AdamW, a
checkpoint every 4 steps) gives the reference weights (SHA-256). Then each trial starts
the same run under `meshfit run --max-restarts 3 --hang-timeout S` and, from outside:

- kill:     SIGKILL a random rank at a random moment (start-up, steps and saves alike);
- kill-save: SIGKILL a random rank while a checkpoint is being written (`.partial` seen);
- stop:     SIGSTOP a random rank at a random moment (a hang: the watchdog must name it);
            with --stop-when training, soon after the first checkpoint (past start-up,
            whose hang verdict waits for the watchdog's 60 s start-up floor);
- corrupt:  flip 8 bytes in a random file of the newer of two committed checkpoints,
            then SIGKILL a rank so the restart has to load (it must fall back to the
            older, intact one);
- diskfull: the checkpoint directory is a tmpfs with room for two checkpoints (root
            only); the third save fails, then the tmpfs grows and the run is started again.

Outcomes: "exact" (finished, weights bit-identical to the reference), "refused+exact"
(stopped with one meshfit line and nothing lost: a plain re-run resumes to the exact
weights), and the failures "MISMATCH", "FAILED" (a traceback, no meshfit line), "HANG"
(still running at the limit with no worker using the CPU) and "TIMEOUT" (still running
at the limit, but its workers were computing: a machine too slow for the limit, or a
rank spinning in a hang that meshfit's detection missed; a failure either way, to be
read, never counted as good). Each run's limit is the larger of --limit and --limit-factor times
the plan's undisturbed run, so a loaded machine, which slows every run alike, does not
turn a live run into a failure.

    python benchmarks/faults.py --trials 2                       # every plan and fault
    python benchmarks/faults.py --plans dp=2 --faults kill --trials 1

Writes a JSON list of trials (default benchmarks/results/faults-cpu.json) and prints the
table BENCHMARKS.md shows.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "fault_train.py")
PLANS = {"dp=2": 2, "fsdp=2": 2, "tp=2": 2, "pp=2": 2, "dp=2,tp=2,pp=2": 8}
FAULTS = ("kill", "kill-save", "stop", "corrupt", "diskfull")
GOOD = ("exact", "refused+exact")


@dataclass
class Trial:
    plan: str
    fault: str
    outcome: str
    seconds: float
    rank: int | None = None
    at_s: float | None = None  # when the fault hit, from the start of the run
    detail: str = ""


def run_training(
    plan: str, ckpt: str, out: str, hang_timeout: float, restarts: int
) -> subprocess.Popen:
    meshfit = os.path.join(os.path.dirname(sys.executable), "meshfit")
    argv = [meshfit, "run", "--nproc", str(PLANS[plan]), "--max-restarts", str(restarts)]
    argv += ["--hang-timeout", str(hang_timeout), TRAIN, "--plan", plan]
    argv += ["--checkpoint-dir", ckpt, "--out", out]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def workers(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's live training workers."""
    found = {}
    try:
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return found
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            found[int(env[b"RANK"])] = pid
    return found


def wait_for_workers(launcher: subprocess.Popen) -> dict[int, int]:
    """The live workers, waiting for the launcher to start them: on a loaded machine its
    own start-up (importing torch) can outlast a fault's delay (15% of the undisturbed
    run), and a fault with no process to hit would leave the trial undisturbed, with no
    rank (seen in CI). Empty only if the run ended first."""
    while not (alive := workers(launcher)) and launcher.poll() is None:
        time.sleep(0.02)
    return alive


def committed(ckpt: str) -> list[str]:
    return sorted(
        d for d in glob.glob(os.path.join(ckpt, "step-*"))
        if not d.endswith((".partial", ".old")) and os.path.exists(os.path.join(d, "meshfit.json"))
    )  # fmt: skip


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) of a process that is not stopped; None if it is stopped
    (SIGSTOP: state T) or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("T", "t", "Z", "X"):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def computing(launcher: subprocess.Popen, window_s: float = 3.0) -> bool:
    """Whether any live worker of the launcher used the CPU (>= 10% of a core) during
    `window_s`: a slow run still training, as opposed to one that hangs."""
    before = {pid: cpu_seconds(pid) for pid in workers(launcher).values()}
    time.sleep(window_s)
    for pid, was in before.items():
        now = cpu_seconds(pid)
        if was is not None and now is not None and now - was >= 0.1 * window_s:
            return True
    return False


def finish(launcher: subprocess.Popen, limit_s: float) -> tuple[int | None, str, bool]:
    """(exit code, stderr, whether the limit cut short a run whose workers were still
    computing). The exit code is None when the run hit the limit and was killed."""
    try:
        _, err = launcher.communicate(timeout=limit_s)
        return launcher.returncode, err, False
    except subprocess.TimeoutExpired:
        live = computing(launcher)
        stray = list(workers(launcher).values())  # in sessions of their own
        for pid in stray:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        _, err = launcher.communicate()
        return None, err, live


def meshfit_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("meshfit: error:")]
    return lines[-1][:300] if lines else ""


def digest_of(out: str) -> str | None:
    try:
        with open(out) as f:
            return json.load(f)["digest"]
    except (OSError, ValueError, KeyError):
        return None


def judge(
    rc: int | None, stderr: str, out: str, reference: str, live: bool = False, limit_s: float = 0
) -> tuple[str, str]:
    last = stderr.strip().splitlines()[-1][:300] if stderr.strip() else ""
    if rc is None and live:
        return "TIMEOUT", (
            f"still computing after the {limit_s:.0f} s limit (a slow machine, or a busy "
            f"hang meshfit did not detect); last line: {last}"
        )
    if rc is None:
        return "HANG", last
    if rc == 0:
        return ("exact", "") if digest_of(out) == reference else ("MISMATCH", "")
    line = meshfit_line(stderr)
    if not line:
        return "FAILED", stderr.strip().splitlines()[-1][:300] if stderr.strip() else f"rc {rc}"
    return "refused", line


@contextlib.contextmanager
def checkpoint_dir(fault: str, size_bytes: int) -> tuple[str, bool]:
    where = tempfile.mkdtemp(prefix="meshfit-faults-")
    mounted = False
    if fault == "diskfull":
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", where], check=True
        )
        mounted = True
    try:
        yield where
    finally:
        if mounted:
            subprocess.run(["umount", where], check=False)
        shutil.rmtree(where, ignore_errors=True)


def run_limit(ref_seconds: float, args) -> float:
    """Seconds a run may take before it is stopped: --limit, or --limit-factor times the
    undisturbed run when the machine is slower than that allows (a run that is slow
    because the machine is busy is slow in the undisturbed run too)."""
    return max(args.limit, args.limit_factor * ref_seconds)


def trial(
    plan: str, fault: str, reference: str, ref_seconds: float, ckpt_bytes: int, args
) -> Trial:
    limit = run_limit(ref_seconds, args)
    rng = random.Random(f"{args.seed}-{plan}-{fault}-{time.time_ns()}")
    started = time.monotonic()
    with checkpoint_dir(fault, int(2.6 * ckpt_bytes)) as ckpt:
        out = os.path.join(ckpt, "..", f"{os.path.basename(ckpt)}.json")
        launcher = run_training(plan, ckpt, out, args.hang_timeout, restarts=3)
        rank = at = None
        if fault in ("kill", "stop", "corrupt"):
            # A stop after a rank's last collective leaves its peers finished and the
            # launcher waiting on the stopped process for good (torch's agent; open, see
            # BENCHMARKS.md), so stops land in the first 60% of the run.
            if fault == "stop" and args.stop_when == "training":
                while not committed(ckpt) and launcher.poll() is None:
                    time.sleep(0.02)
                # a second at most: 12 steps remain, about 3 s on the 2-core VM; a
                # fraction of the undisturbed run (mostly start-up on a busy machine)
                # could land after the last collective
                delay = rng.uniform(0.0, 1.0)
            else:
                delay = rng.uniform(0.15, 0.6 if fault == "stop" else 0.9) * ref_seconds
            if fault == "corrupt":  # the newest of two, so an intact one remains
                while len(committed(ckpt)) < 2 and launcher.poll() is None:
                    time.sleep(0.02)
                newest = committed(ckpt)[-1:] if committed(ckpt) else []
                files = [
                    f
                    for d in newest
                    for f in glob.glob(os.path.join(d, "**", "*.distcp"), recursive=True)
                ]
                if files:
                    victim = rng.choice(files)
                    with open(victim, "r+b") as f:
                        size = os.path.getsize(victim)
                        f.seek(rng.randrange(max(1, size - 8)))
                        f.write(bytes(rng.randrange(256) for _ in range(8)))
                delay = 0.05
            time.sleep(delay)
            alive = wait_for_workers(launcher)
            if alive:
                rank = rng.choice(sorted(alive))
                at = time.monotonic() - started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(alive[rank], signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        elif fault == "kill-save":
            while launcher.poll() is None and not glob.glob(os.path.join(ckpt, "*.partial")):
                time.sleep(0.002)
            alive = workers(launcher)
            if alive:
                rank = rng.choice(sorted(alive))
                at = time.monotonic() - started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(alive[rank], signal.SIGKILL)
        rc, err, live = finish(launcher, limit)
        outcome, detail = judge(rc, err, out, reference, live, limit)
        detail = detail or meshfit_line(err)  # what the user was told (a hang's naming)
        if outcome == "refused":
            if fault == "diskfull":
                subprocess.run(["mount", "-o", f"remount,size={20 * ckpt_bytes}", ckpt], check=True)
            again = run_training(plan, ckpt, out, args.hang_timeout, restarts=0)
            rc2, err2, live2 = finish(again, limit)
            second, _ = judge(rc2, err2, out, reference, live2, limit)
            outcome = "refused+exact" if second == "exact" else f"refused+{second}"
        with contextlib.suppress(OSError):
            os.remove(out)
    return Trial(
        plan,
        fault,
        outcome,
        round(time.monotonic() - started, 1),
        rank,
        at and round(at, 2),
        detail,
    )


def reference_run(plan: str, args) -> tuple[str, float, int]:
    with checkpoint_dir("none", 0) as ckpt:
        out = ckpt + ".json"
        started = time.monotonic()
        launcher = run_training(plan, ckpt, out, args.hang_timeout, restarts=0)
        rc, err, live = finish(launcher, args.limit)
        seconds = time.monotonic() - started
        digest = digest_of(out)
        if rc is None and live:
            raise SystemExit(
                f"the undisturbed {plan} run timed out: still computing after the "
                f"{args.limit:.0f} s limit (a machine this busy needs a larger --limit)"
            )
        if rc != 0 or digest is None:
            raise SystemExit(f"the undisturbed {plan} run failed:\n{err[-3000:]}")
        size = max(
            sum(
                os.path.getsize(f)
                for f in glob.glob(os.path.join(d, "**", "*"), recursive=True)
                if os.path.isfile(f)
            )
            for d in committed(ckpt)
        )
        os.remove(out)
    return digest, seconds, size


def save(trials: list[Trial], out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump([asdict(t) for t in trials], f, indent=1)


def table(trials: list[Trial]) -> str:
    rows = [
        "| plan | fault | trials | exact | refused, then exact | other |",
        "|---|---|---|---|---|---|",
    ]
    for plan in dict.fromkeys(t.plan for t in trials):
        for fault in dict.fromkeys(t.fault for t in trials):
            cell = [t for t in trials if t.plan == plan and t.fault == fault]
            if not cell:
                continue
            counts = Counter(t.outcome for t in cell)
            other = ", ".join(f"{k} {v}" for k, v in counts.items() if k not in GOOD) or "0"
            rows.append(
                f"| {plan} | {fault} | {len(cell)} | {counts['exact']} | {counts['refused+exact']} | {other} |"
            )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--trials", type=int, default=2, help="trials per plan and fault")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument(
        "--limit",
        type=float,
        default=300.0,
        help="seconds a run may take at least before it is stopped (HANG, or TIMEOUT when "
        "its workers were still computing)",
    )
    parser.add_argument(
        "--limit-factor",
        type=float,
        default=4.0,
        help="a run may also take this many times the plan's undisturbed run",
    )
    parser.add_argument(
        "--stop-when",
        choices=("any", "training"),
        default="any",
        help="stop: at any moment (start-up included), or soon after the first checkpoint",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "faults-cpu.json"))
    args = parser.parse_args()
    if "diskfull" in args.faults and os.geteuid() != 0:
        print("faults: diskfull needs root (a tmpfs mount); skipped", file=sys.stderr)
        args.faults = [f for f in args.faults if f != "diskfull"]
    trials: list[Trial] = []
    for plan in args.plans:
        reference, seconds, ckpt_bytes = reference_run(plan, args)
        print(
            f"{plan}: undisturbed run {seconds:.1f} s, checkpoint {ckpt_bytes / 1e6:.2f} MB, "
            f"limit per run {run_limit(seconds, args):.0f} s",
            flush=True,
        )
        for fault in args.faults:
            for _ in range(args.trials):
                t = trial(plan, fault, reference, seconds, ckpt_bytes, args)
                trials.append(t)
                save(trials, args.out)  # as it goes: a long campaign cut short keeps its trials
                print(
                    f"  {fault:9s} rank {t.rank} at {t.at_s} s -> {t.outcome} ({t.seconds} s) {t.detail[:160]}",
                    flush=True,
                )
    print(table(trials))
    return 0 if all(t.outcome in GOOD for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
