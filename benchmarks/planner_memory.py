"""Measured peak memory per rank of one training step, by plan: what the planner's memory
estimate (issue 12) is checked against.

meshfit's GPT (CONFIG below, float32, AdamW) trains with `engine.step` on the GLOBAL
batch; the SECOND step is measured (the first makes AdamW's state) with
`meshfit.planner.memory_probe.measure_peak`: the peak of live tensor bytes on each rank, split at
that moment into parameters, gradients, optimizer state and the rest (activations,
gathered parameters, communication and temporary buffers). One-process plans run here,
the others on CPU workers started with `mf.launch` (gloo, one thread each), all plans of
one world size in one launch.

    python benchmarks/planner_memory.py            # every plan, 3-D included (~3 min)
    python benchmarks/planner_memory.py --no-3d    # without the 8-worker plan
    python benchmarks/planner_memory.py --quick    # smoke test: tiny, one process

Each rank's row also has independent checks: the engine's own count of parameters and
optimizer state (`memory_report`, without AdamW's 0-dim step counts) and the total of the
next step from torch.profiler's memory profile (`profiled_peak`; None where the profiler
fails on its own graph).

Writes benchmarks/results/planner_memory.json (config, batch, plans, per-rank bytes,
torch version, date) and prints a table: per plan, the rank with the largest peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss
from meshfit.planner.memory_probe import measure_peak, profiled_peak

# ---- what is measured: the predictor reads these same values -------------------------
# Small enough for 2 cores, wide enough that activations are most of a step's peak.
CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, bias=False)
BATCH = 8  # global batch (sequences of CONFIG.block_size tokens)
DTYPE = torch.float32
LR = 3e-4  # AdamW (torch defaults otherwise: one parameter at a time on the CPU, betas,
# weight_decay=0.01)
SEED = 0
MEASURED_STEP = 2
# (plan, workers); pipeline plans: 4 micro-batches per rank's share
PLANS: list[tuple[str, int]] = [
    ("none", 1),
    ("checkpointing=full", 1),
    ("checkpointing=selective", 1),
    ("dp=2", 2),
    ("fsdp=2", 2),
    ("tp=2", 2),
    ("pp=2,schedule=gpipe,microbatches=4", 2),
    ("pp=2,schedule=1f1b,microbatches=4", 2),
    ("fsdp=2,checkpointing=full", 2),
    ("dp=2,tp=2,pp=2,schedule=1f1b,microbatches=4", 8),
]
CATEGORIES = ("parameters", "gradients", "optimizer", "other")
# --quick: a smoke test of the script (tiny model, one-process plans)
TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)


def make_batch(step: int, config: GPTConfig = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def measure(plan: str, config: GPTConfig = CONFIG) -> dict:
    """This rank's peak during step MEASURED_STEP of the GPT under `plan`."""
    torch.manual_seed(SEED)
    model = GPT(config).to(DTYPE)
    engine = mf.parallelize(
        model,
        None if plan == "none" else plan,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
        loss_fn=next_token_loss,
    )
    for step in range(1, MEASURED_STEP):
        engine.step(make_batch(step, config))
    batch = make_batch(MEASURED_STEP, config)
    gc.collect()  # what the earlier steps left for the collector is not this step's
    start = time.perf_counter()
    peak = measure_peak(lambda: engine.step(batch), engine=engine)
    seconds = time.perf_counter() - start
    # Independent checks: the model state as the engine counts it, and the total of the
    # next step (same shapes, so the same bytes) from torch.profiler's memory profile.
    report = engine.memory_report()
    gc.collect()
    profiled = profiled_peak(lambda: engine.step(batch))
    row = {
        "rank": engine.rank,
        **peak.as_dict(),
        "measured_step_s": round(seconds, 3),
        "check_parameters": report["parameters"],
        "check_optimizer": report["optimizer"],
        "check_profiler_total": profiled,
    }
    return row  # the engine goes with this frame; callers collect before the next plan


def worker(plans: list[str], config: Any, measure_fn: Callable = measure) -> list[list[dict]]:
    """Every plan in one set of workers: per plan, every rank's row (rank order), as
    `measure_fn(plan, config)` measures it (benchmarks/planner_experts.py passes its own)."""
    torch.set_num_threads(1)
    out = []
    for plan in plans:
        row = measure_fn(plan, config)
        gc.collect()
        rows: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        out.append(rows)
    return out


def run_all(
    plans: list[tuple[str, int]], config: Any, measure_fn: Callable = measure
) -> list[dict]:
    """Every plan, those of one world size in one launch: per plan, every rank's row and
    the largest rank's."""
    results = []
    for nproc in sorted({n for _, n in plans}):
        names = [p for p, n in plans if n == nproc]
        start = time.perf_counter()
        if nproc == 1:
            torch.set_num_threads(1)
            per_plan = []
            for plan in names:
                per_plan.append([measure_fn(plan, config)])
                gc.collect()
        else:
            per_plan = mf.launch(worker, nproc=nproc, args=(names, config, measure_fn))
        seconds = time.perf_counter() - start
        for plan, rows in zip(names, per_plan, strict=True):
            largest = max(rows, key=lambda r: r["total"])
            results.append(
                {
                    "plan": plan,
                    "nproc": nproc,
                    "ranks": rows,
                    "largest_rank": {k: largest[k] for k in ("rank", "total", *CATEGORIES)},
                    "max_over_ranks": {k: max(r[k] for r in rows) for k in ("total", *CATEGORIES)},
                    "launch_seconds": round(seconds, 1),  # all plans of this world size
                }
            )
    order = [p for p, _ in plans]
    return sorted(results, key=lambda r: order.index(r["plan"]))


def predicted(plans: list[tuple[str, int]], config: GPTConfig = CONFIG) -> dict[str, float]:
    """The planner's peak bytes on the fullest rank for each plan (mf.estimate on the
    same model, built on meta, the same batch, loss and optimizer)."""
    from meshfit.planner import estimate, profile_model

    with torch.device("meta"):
        model = GPT(config).to(DTYPE)
    example = make_batch(0, config)
    profile = profile_model(model, example[0], loss_fn=next_token_loss, example_targets=example[1])
    return {
        plan: estimate(
            profile, "dp=1" if plan == "none" else plan, batch_size=BATCH, world_size=nproc
        ).memory.total
        for plan, nproc in plans
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-3d", action="store_true", help="skip the 8-worker plan")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny, one process")
    parser.add_argument("--only", default=None, help="run only plans containing this text")
    parser.add_argument("--nproc", type=int, default=None, help="run only plans of this size")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = TINY if args.quick else CONFIG
    plans = [(p, n) for p, n in PLANS if not (args.no_3d and n == 8)]
    if args.quick:
        plans = [(p, n) for p, n in plans if n == 1]
    if args.nproc:
        plans = [(p, n) for p, n in plans if n == args.nproc]
    if args.only:
        plans = [(p, n) for p, n in plans if args.only in p]
    start = time.perf_counter()
    results = run_all(plans, config)
    seconds = time.perf_counter() - start
    guesses = predicted(plans, config)
    for r in results:
        r["predicted_total"] = guesses[r["plan"]]
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"planner_memory{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "planner-memory",
                "config": vars(config),
                "batch": BATCH,
                "dtype": str(DTYPE).removeprefix("torch."),
                "optimizer": f"AdamW(lr={LR})",
                "measured_step": MEASURED_STEP,
                "probe": "meshfit.planner.memory_probe.measure_peak (live tensor storage bytes)",
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "seconds": round(seconds, 1),
                "plans": results,
            },
            f,
            indent=1,
        )
    mb = 2**20
    print(
        f"GPT {config.n_layer} blocks x {config.n_embd}, vocab {config.vocab_size}, "
        f"{BATCH} x {config.block_size} tokens, float32, AdamW; step {MEASURED_STEP}; "
        f"{seconds:.0f} s; {out}"
    )
    print("MiB, the rank with the largest peak (prof.: its total from torch.profiler):")
    print(
        f"{'plan':<46} {'rank':>4} {'total':>7} {'params':>7} {'grads':>7} {'optim':>7} "
        f"{'other':>7} {'prof.':>7} {'planner':>7} {'off':>5}  peak at"
    )
    for r in results:
        big = r["largest_rank"]
        where = next(x for x in r["ranks"] if x["rank"] == big["rank"])
        print(
            f"{r['plan']:<46} {big['rank']:>4} "
            + " ".join(f"{big[k] / mb:>7.2f}" for k in ("total", *CATEGORIES))
            + (
                f" {where['check_profiler_total'] / mb:>7.2f}"
                if where["check_profiler_total"] is not None
                else f" {'n/a':>7}"
            )
            + f" {r['predicted_total'] / mb:>7.2f} {100 * (r['predicted_total'] / big['total'] - 1):>+4.0f}%"
            + f"  {where['phase']} ({where['op']})"
        )


if __name__ == "__main__":
    main()
