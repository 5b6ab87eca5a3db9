"""Pipeline parallel: measured pp=2 step time against the ideal (one process's time / pp)
and the bubble theory, ideal x (m + p - 1) / m, for GPipe and 1F1B on CPU workers.

Each worker gets one core (1 thread), and so does the one-process reference, so "ideal"
is what two perfectly busy cores would do. The reference runs the same micro-batches
(gradient accumulation over m of them), so smaller matrix products at larger m are not
blamed on the schedule. The model is the demo GPT with 8 blocks, cut
evenly (pp_split=[4]).

    python benchmarks/pipeline.py            # a few minutes on 2 cores
    python benchmarks/pipeline.py --quick    # smoke test: checks the script works

Prints a table last and writes JSON to benchmarks/results/pipeline-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned workers import us

import meshfit as mf  # noqa: E402
from meshfit.models import GPT, GPTConfig, next_token_loss  # noqa: E402


def _batches(config: GPTConfig, steps: int, batch_size: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (steps, batch_size, config.block_size + 1), generator=g
    )
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def seconds_per_step(config: GPTConfig, plan: str, steps: int, batch_size: int, **options) -> float:
    torch.manual_seed(0)
    engine = mf.parallelize(
        GPT(config),
        plan,
        loss_fn=next_token_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        **options,
    )
    batches = _batches(config, steps + 2, batch_size)
    for batch in batches[:2]:  # warm-up
        engine.step(batch)
    times = []
    for batch in batches[2:]:
        start = time.perf_counter()
        float(engine.step(batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(config: GPTConfig, cases: list[tuple[str, int]], steps: int, batch_size: int) -> list:
    split = [config.n_layer // 2]
    return [
        seconds_per_step(
            config, f"pp=2,schedule={schedule},microbatches={m}", steps, batch_size, pp_split=split
        )
        for schedule, m in cases
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = GPTConfig(n_layer=8)
    microbatches = (2, 4, 8)
    if args.quick:
        config = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
        args.steps, args.batch_size, microbatches = 1, 4, (2,)
    cases = [(s, m) for s in ("gpipe", "1f1b") for m in microbatches]
    torch.set_num_threads(1)
    one = {
        m: seconds_per_step(config, f"dp=1,microbatches={m}", args.steps, args.batch_size)
        for m in microbatches
    }
    measured = mf.launch(worker, nproc=2, args=(config, cases, args.steps, args.batch_size))
    p = 2
    rows = [
        {
            "schedule": s,
            "microbatches": m,
            "step_s": t,
            "one_process_s": one[m],
            "ideal_s": one[m] / p,
            "theory_s": one[m] / p * (m + p - 1) / m,
            "vs_ideal": t / (one[m] / p),
            "vs_theory": t / (one[m] / p * (m + p - 1) / m),
        }
        for (s, m), t in zip(cases, measured, strict=True)
    ]
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"pipeline-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "pipeline",
                "pp": p,
                "one_process_step_s": one,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "config": vars(config),
                "batch_size": args.batch_size,
                "steps": args.steps,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"pp=2 on 2 CPU workers vs one process (1 thread); results in {out}")
    print(
        f"{'schedule':<8} {'m':>3} {'1-proc s':>9} {'step s':>8} {'ideal s':>8} {'theory s':>9} "
        f"{'vs ideal':>9} {'vs theory':>10}"
    )
    for r in rows:
        print(
            f"{r['schedule']:<8} {r['microbatches']:>3} {r['one_process_s']:>9.3f} {r['step_s']:>8.3f} "
            f"{r['ideal_s']:>8.3f} {r['theory_s']:>9.3f} {r['vs_ideal']:>9.2f} {r['vs_theory']:>10.2f}"
        )


if __name__ == "__main__":
    main()
