"""Tensor parallel with the LM head split over the vocabulary (logits gathered) against
the head kept whole on every tp rank, on 2 CPU workers (gloo).

A GPT with a 32,000-token vocabulary, so the head is as large as it is in real language
models (here 8.2M of 17.9M parameters): meshfit's `tp=2` with its default (head split)
and with the head left whole as before 2026-11-24. Both engines live in the same
workers from the same seed and are timed in alternating rounds, barrier to barrier;
parameters per rank are counted from the local shards.

    python benchmarks/tp_head.py [--rounds 6] [--steps 5] [--out results.json]
    python benchmarks/tp_head.py --quick    # tiny model, one round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist
from steptimes import timed_steps, warm_gpt_engine
from torch.distributed.tensor import DTensor

import meshfit as mf
from meshfit.models import GPTConfig

CONFIG = GPTConfig(vocab_size=32000, block_size=64, n_layer=2, n_head=4, n_embd=256, bias=False)
QUICK = GPTConfig(vocab_size=512, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)


def _local_numel(engine: mf.Engine) -> int:
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel()
        for p in engine.user_model.parameters()
    )


def compare(config: GPTConfig, rounds: int, steps: int, batch_size: int) -> dict:
    torch.set_num_threads(1)
    split, batch = warm_gpt_engine(config, "tp=2", batch_size)
    with mock.patch("meshfit.parallel.tensor.apply.gathered_heads", lambda *a, **k: ({}, {})):
        whole, _ = warm_gpt_engine(config, "tp=2", batch_size)
    times: dict[str, list[float]] = {"split": [], "whole": []}
    for _ in range(rounds):
        for name, engine in (("split", split), ("whole", whole)):
            times[name].append(statistics.median(timed_steps(engine, batch, steps)))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    return {  # a step takes as long as its slower rank
        "params_per_rank": {"split": _local_numel(split), "whole": _local_numel(whole)},
        "step_s": {k: [max(r[k][i] for r in every) for i in range(rounds)] for k in times},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else CONFIG
    if args.quick:
        args.rounds, args.steps = 1, 1
    start = time.perf_counter()
    result = mf.launch(compare, nproc=2, args=(config, args.rounds, args.steps, args.batch_size))
    step, params = result["step_s"], result["params_per_rank"]
    ratios = [s / w for s, w in zip(step["split"], step["whole"], strict=True)]
    summary = {
        "config": str(config),
        "batch_size": args.batch_size,
        "params_per_rank": params,
        "step_s_median": {k: statistics.median(v) for k, v in step.items()},
        "split_over_whole_per_round": ratios,
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
    }
    print(
        f"parameters per rank: split {params['split'] / 1e6:.2f}M, whole "
        f"{params['whole'] / 1e6:.2f}M ({params['split'] / params['whole'] - 1:+.0%})\n"
        f"step (median of {args.rounds} rounds x {args.steps} steps): split "
        f"{summary['step_s_median']['split'] * 1e3:.0f} ms, whole "
        f"{summary['step_s_median']['whole'] * 1e3:.0f} ms; split/whole per round "
        + ", ".join(f"{r:.2f}" for r in ratios)
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
