"""The planner's memory for compiled steps, against a compiled step measured on the CPU.

`mf.estimate(..., compiled=True)` counts what a compiled step saves for backward by
running torch's partitioner on fake tensors (planner/compiled_memory.py). This trains
meshfit's GPT in one process through `mf.parallelize(..., compile=True)` (Inductor's CPU
code: the same partitioner as on a GPU) and measures one step's peak with torch.profiler's
memory profile (`memory_probe.profiled_peak`: it sees Inductor's own allocations, which a
dispatch mode does not), eager and compiled, float32 and bf16 autocast, with and without
full recomputation; each row beside the estimate of the same plan, and the compiled rows
beside what the eager count would have said.

    python benchmarks/planner_compiled.py           # 8 rows, about a minute on 2 cores
    python benchmarks/planner_compiled.py --quick   # 2 rows of a tiny model

Writes benchmarks/results/planner-compiled-cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss
from meshfit.planner import estimate
from meshfit.planner.memory_probe import profiled_peak

# the logits (8 x 256 x 8,192) are a fifth of the step, as at a large vocabulary
CONFIG = GPTConfig(vocab_size=8192, block_size=256, n_layer=4, n_head=4, n_embd=256, bias=False)
QUICK = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False)
BATCH = 8
PLANS = [
    f"dp=1,precision={precision},checkpointing={recompute}"
    for precision in ("fp32", "bf16")
    for recompute in ("none", "full")
]


def run_one(config: GPTConfig, plan: str, compiled: bool) -> dict:
    """One row: the measured peak of the second step, the estimate, and (compiled) the
    estimate that counts the step as eager."""
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.block_size + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    engine = mf.parallelize(
        GPT(config),
        plan,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        loss_fn=next_token_loss,
        compile=compiled,
    )
    engine.step(batch)  # compilation and AdamW's state: the second step is measured
    measured = profiled_peak(lambda: engine.step(batch))
    with torch.device("meta"):
        meta_model = GPT(config)

    def predicted(as_compiled: bool) -> float:
        return estimate(
            meta_model,
            plan,
            batch_size=BATCH,
            example_inputs=batch[0][:1],
            compiled=as_compiled,
            world_size=1,
        ).memory.total

    return {
        "plan": plan,
        "compiled": compiled,
        "measured_peak_bytes": measured,
        "predicted_bytes": predicted(compiled),
        "counted_as_eager_bytes": predicted(False) if compiled else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rows")
    parser.add_argument("--out", default=None, help="the JSON to write (default under results/)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    config = QUICK if args.quick else CONFIG
    plans = PLANS[:1] if args.quick else PLANS
    rows = [run_one(config, plan, compiled) for plan in plans for compiled in (False, True)]
    print("| plan | mode | measured MiB | predicted MiB | off | counted as eager |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        off = r["predicted_bytes"] / r["measured_peak_bytes"] - 1
        eager = r["counted_as_eager_bytes"]
        as_eager = f"{eager / r['measured_peak_bytes'] - 1:+.0%}" if eager else "-"
        print(
            f"| `{r['plan']}` | {'compiled' if r['compiled'] else 'eager'} | "
            f"{r['measured_peak_bytes'] / 2**20:.1f} | {r['predicted_bytes'] / 2**20:.1f} | "
            f"{off:+.0%} | {as_eager} |"
        )
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", "planner-compiled-cpu.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "planner-compiled",
                "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
                "config": vars(config),
                "batch": BATCH,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
