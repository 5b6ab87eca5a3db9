"""Does the planner rank plans as measurement does? Step times of the demo GPT under
several plans on 2 CPU workers, beside the planner's prediction for each.

Issue 12's check on CPU workers, where timings scatter: for every pair of plans whose
measured times differ by more than their spread (each plan's slowest minus fastest
step), the planner must put them in the same order.

    python benchmarks/planner_ranking.py            # 5 plans, 6 timed steps each
    python benchmarks/planner_ranking.py --quick    # tiny model, 2 plans, 2 steps

The hardware is this machine, measured once (`mf.planner.measure(..., network=True)`:
matmul rate at the model's width, cost per operator and per DTensor layer, gloo's
all-reduce bandwidth), with the matmul rate halved when 2 workers share 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import torch
from steptimes import timed_steps, warm_gpt_engine

import meshfit as mf
from meshfit.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
BATCH = 32
PLANS = ["dp=2", "fsdp=2", "tp=2", "pp=2,microbatches=4", "dp=2,checkpointing=full"]


def worker(plans: list[str], config: GPTConfig, steps: int) -> list[list[float]]:
    """Every plan in one set of workers: the step times (barrier to barrier)."""
    times = []
    for plan in plans:
        engine, batch = warm_gpt_engine(config, plan, BATCH)
        times.append(timed_steps(engine, batch, steps))
    return times


def predictions(plans: list[str], config: GPTConfig) -> dict[str, float]:
    from meshfit.planner import estimate, measure, profile_model

    with torch.device("meta"):
        model = GPT(config)
    profile = profile_model(model, torch.zeros(1, config.block_size, dtype=torch.long))
    here = measure(width=config.n_embd, processes=2, network=True)
    share = min(1.0, (os.cpu_count() or 1) / 2)
    hw = dataclasses.replace(
        here,
        matmul_flops={k: v * share for k, v in here.matmul_flops.items()},
        op_overhead=here.op_overhead / share,
        devices_per_node=2,
    )
    return {p: estimate(profile, p, batch_size=BATCH, hardware=hw).step_time.total for p in plans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config, plans, steps = (TINY, PLANS[:2], 2) if args.quick else (CONFIG, PLANS, args.steps)
    measured = mf.launch(worker, nproc=2, args=(plans, config, steps))
    predicted = predictions(plans, config)
    rows = [
        {
            "plan": p,
            "median_s": statistics.median(t),
            "spread_s": max(t) - min(t),
            "steps_s": t,
            "predicted_s": predicted[p],
        }
        for p, t in zip(plans, measured, strict=True)
    ]
    print("| plan | measured median (s) | spread (s) | predicted (s) |\n| --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['plan']} | {r['median_s']:.3f} | {r['spread_s']:.3f} | {r['predicted_s']:.3f} |"
        )
    pairs = agreements(rows)
    agree = sum(1 for p in pairs if p["agree"])
    print(
        f"\npairs measured apart by more than their spread: {len(pairs)}; planner agrees: {agree}"
    )
    for p in pairs:
        if not p["agree"]:
            print(f"  disagrees: {p['faster']} measured faster than {p['slower']}")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "planner-ranking-cpu.json")
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows, "pairs": pairs}, f, indent=1)


def agreements(rows: list[dict]) -> list[dict]:
    """Pairs of plans whose medians differ by more than both spreads together, and
    whether the planner orders them the same way."""
    pairs = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if abs(a["median_s"] - b["median_s"]) <= a["spread_s"] + b["spread_s"]:
                continue
            fast, slow = (a, b) if a["median_s"] < b["median_s"] else (b, a)
            pairs.append(
                {
                    "faster": fast["plan"],
                    "slower": slow["plan"],
                    "agree": fast["predicted_s"] < slow["predicted_s"],
                }
            )
    return pairs


if __name__ == "__main__":
    main()
