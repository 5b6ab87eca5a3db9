"""Pipeline parallel: the memory each stage keeps of the weights other stages train.

Every stage runs the model's own forward, so it keeps something in place of the
embeddings (first stage's) and the final norm and LM head (last stage's). meshfit kept
frozen full copies until 2026-11-22; now it keeps one-element placeholders. Per rank,
this prints the bytes of the weights it trains, of what it keeps for the other stages
(real storage, and what full copies of the same tensors would take) and its resident
memory after the split. The model is the 405M GPT of gpu_throughput.py (vocabulary
50,304, width 1024, 24 blocks), fp32, on CPU workers; nothing is trained.

    python benchmarks/pipeline_memory.py             # pp=4, about a minute, ~7 GB RAM
    python benchmarks/pipeline_memory.py --quick     # smoke test: checks the script works

Prints a table last and writes JSON to benchmarks/results/pipeline-memory-cpu.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss

GPT_400M = GPTConfig(
    vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024, bias=False
)
TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(config: GPTConfig, pp: int) -> list[dict]:
    torch.manual_seed(0)
    engine = mf.parallelize(GPT(config), f"pp={pp}", loss_fn=next_token_loss)
    gc.collect()
    trained = engine.memory_report()["parameters"]
    kept = [b for b in engine.parallel_model.buffers()]  # the GPT's only buffers: the placeholders
    row = {
        "rank": engine.rank,
        "trained_bytes": trained,
        "kept_storage_bytes": sum(b.untyped_storage().nbytes() for b in kept),
        "full_copy_bytes": sum(b.numel() * b.element_size() for b in kept),
        "resident_bytes": resident_bytes(),
    }
    rows: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = TINY if args.quick else GPT_400M
    pp = 2 if args.quick else args.pp
    rows = mf.launch(worker, nproc=pp, args=(config, pp))
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"pipeline-memory-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "pipeline-memory",
                "pp": pp,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "config": vars(config),
                "rows": rows,
            },
            f,
            indent=1,
        )
    mb = 1e6
    print(
        f"pp={pp} on CPU workers, GPT {config.n_layer} blocks x {config.n_embd}, "
        f"vocabulary {config.vocab_size}, fp32; results in {out}"
    )
    print(f"{'rank':>4} {'trained MB':>11} {'kept MB':>8} {'as copies MB':>13} {'resident MB':>12}")
    for r in rows:
        print(
            f"{r['rank']:>4} {r['trained_bytes'] / mb:>11.1f} {r['kept_storage_bytes'] / mb:>8.3f} "
            f"{r['full_copy_bytes'] / mb:>13.1f} {r['resident_bytes'] / mb:>12.1f}"
        )


if __name__ == "__main__":
    main()
