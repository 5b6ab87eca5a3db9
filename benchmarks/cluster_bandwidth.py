"""Step time of the demo GPT on 2 hosts x 2 CPU workers, by link bandwidth: dp=4 (every
gradient crosses the link) against dp=2,tp=2 (tensor parallel inside a host, only dp's
all-reduce of half-size gradient shards between hosts).

The hosts are network namespaces on a bridge (tests/cluster.py, needs root and ip); each
host's link is shaped both ways with `tc qdisc ... tbf` to the rate given, or left
unshaped (a veth pair: memory speed). One `meshfit run` per host and bandwidth runs both
plans one after the other; each plan times --steps steps after 2 warm-up steps, with a
barrier on both sides, and counts the bytes eth0 sent.

    python benchmarks/cluster_bandwidth.py                       # 100mbit, 1gbit, unshaped
    python benchmarks/cluster_bandwidth.py --rates 100mbit --steps 3
    python benchmarks/cluster_bandwidth.py --quick --out r.json  # smoke test (tests/)

Prints a table last. No "predicted" column: the planner that would predict these does
not exist yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
PLANS = ("dp=4", "dp=2,tp=2")
PORT = 29500


def _eth0_tx() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def worker(out: str, steps: int, quick: bool) -> None:
    """On every rank (under meshfit run): time each plan; rank 0 writes the results."""
    import torch.distributed as dist

    from meshfit.models import GPT, GPTConfig

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # meshfit run: not there
    from steptimes import timed_steps, warm_gpt_engine

    config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    if quick:  # the demo GPT's shape, tiny: checks the script works, measures nothing
        config = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    results = []
    for plan in PLANS:
        engine, batch = warm_gpt_engine(config, plan, 32)
        sent = _eth0_tx()  # per host; a network namespace's own sysfs
        times = timed_steps(engine, batch, steps)
        sent = _eth0_tx() - sent
        # The slowest rank's time is the step's; bytes per host from each local rank 0.
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"times": times, "sent": sent})
        params = sum(p.numel() for p in GPT(config).parameters())
        step_times = [max(g["times"][i] for g in gathered) for i in range(steps)]
        results.append(
            {
                "plan": plan,
                "params": params,
                "median_s": statistics.median(step_times),
                "step_times": step_times,
                # ranks 0 and 2 are each host's first (2 workers a host)
                "host_mb_per_step": [gathered[r]["sent"] / steps / 1e6 for r in (0, 2)],
            }
        )
        del engine
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def _burst(rate: str) -> str:
    """tbf needs a bucket of at least rate/HZ bytes to reach its rate; a few ms' worth."""
    bits = float(rate.lower().removesuffix("mbit").removesuffix("gbit"))
    bits *= 1e9 if rate.lower().endswith("gbit") else 1e6
    return f"{max(64, int(bits / 8 / 250 / 1024))}kb"


def measure(rate: str | None, steps: int, quick: bool = False) -> list[dict]:
    sys.path.insert(0, TESTS)
    from cluster import Cluster

    env = dict(os.environ, MESHFIT_RUN_SECRET="bench-secret-0123456789abcdef0123")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)  # meshfit picks eth0 itself
    with (
        tempfile.TemporaryDirectory() as tmp,
        Cluster(2, rate=rate, burst=_burst(rate) if rate else "256kb") as cluster,
    ):
        out = os.path.join(tmp, "bench.json")
        argv = [sys.executable, "-m", "meshfit.cli", "run", "--nnodes", "2", "--nproc", "2"]
        argv += ["--master", f"{cluster.hosts[0].addr}:{PORT}", os.path.abspath(__file__)]
        argv += ["--worker", out, "--steps", str(steps)] + (["--quick"] if quick else [])
        results = cluster.run([argv, argv], env=env, timeout=580)
        for r in results:
            if r.returncode != 0:
                raise SystemExit(r.tail(4000))
        with open(out) as f:
            return json.load(f)


# Link rates in bytes/s for the planner; "none" is the unshaped veth pair, where gloo's
# TCP over loopback-like links is the limit (the planner's nominal CPU figure).
RATES = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "none": None}


_MEASURED: list = []  # this machine, measured once per run of the script


def predict(rate: str, quick: bool = False) -> dict[str, float]:
    """The planner's step time for each plan on 2 hosts x 2 workers at `rate`: this
    machine's matmul rate and per-operator cost measured here, halved because 4 workers
    share 2 cores, the inter-host bandwidth set to the link's."""
    import dataclasses

    import torch

    from meshfit.models import GPT, GPTConfig
    from meshfit.planner import estimate, measure, profile_model

    config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    if quick:
        config = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = GPT(config)
    profile = profile_model(model, torch.zeros(1, config.block_size, dtype=torch.long))
    if not _MEASURED:
        _MEASURED.append(measure(width=config.n_embd, processes=2))
    here = _MEASURED[0]
    share = min(1.0, (os.cpu_count() or 1) / 4)
    hw = dataclasses.replace(
        here,
        matmul_flops={k: v * share for k, v in here.matmul_flops.items()},
        op_overhead=here.op_overhead / share,
        nodes=2,
        devices_per_node=2,
    )
    if RATES.get(rate) is not None:
        hw = dataclasses.replace(hw, inter_node_bandwidth=RATES[rate])
    return {
        plan: estimate(profile, plan, batch_size=32, hardware=hw).step_time.total for plan in PLANS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit,none", help="comma-separated tc rates")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 100mbit")
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--predict", action="store_true", help="only the planner's predictions (no root needed)"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.quick)
        return
    if args.predict:
        print("| link | plan | predicted step (s) |\n| --- | --- | --- |")
        for rate in args.rates.split(","):
            for plan, seconds in predict(rate, args.quick).items():
                print(f"| {rate if rate != 'none' else 'unshaped'} | {plan} | {seconds:.3f} |")
        return
    if args.quick:
        args.rates, args.steps = "100mbit", 1
    rows = []
    for rate in args.rates.split(","):
        started = time.monotonic()
        for res in measure(None if rate == "none" else rate, args.steps, args.quick):
            rows.append({"link": rate if rate != "none" else "unshaped", **res})
            print(json.dumps(rows[-1]), flush=True)
        print(f"# {rate}: {time.monotonic() - started:.0f} s", flush=True)
    predicted = {rate: predict(rate, args.quick) for rate in args.rates.split(",")}
    print(
        "\n| link | plan | median step (s) | predicted (s) | steps (s) | MB sent per host per step |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        steps = " ".join(f"{t:.2f}" for t in row["step_times"])
        mb = " / ".join(f"{m:.2f}" for m in row["host_mb_per_step"])
        rate = "none" if row["link"] == "unshaped" else row["link"]
        guess = predicted[rate][row["plan"]]
        print(
            f"| {row['link']} | {row['plan']} | {row['median_s']:.3f} | {guess:.3f} | {steps} | {mb} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
