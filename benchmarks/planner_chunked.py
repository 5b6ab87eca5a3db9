"""The planner's memory with `chunked_loss=True` against a measured step, on the CPU.

A transformers LlamaForCausalLM built from a config (width 256, 2 layers, 4 heads of
which 2 key/value, MLP 512, untied head: the model of benchmarks/head_memory.py), its own
loss (`loss_fn="model"`, a collator's dict), AdamW, batch 4 x 512 tokens, one process:
float32 and bf16 autocast, a 32,000- and a 128,256-word vocabulary, the logits whole and
in chunks, eager; and at 128k words compiled (`compile=True`). Each row's second step is
measured (eager: `memory_probe.measure_peak`, live tensor bytes at the peak; compiled:
`profiled_peak`, torch.profiler's memory profile, which sees Inductor's allocations)
beside `mf.estimate(..., chunked_loss=..., compiled=...)` for the same plan.

    python benchmarks/planner_chunked.py           # 12 rows, about 3 minutes on 2 cores
    python benchmarks/planner_chunked.py --quick   # a 4,096-word vocabulary, 2 rows

Writes benchmarks/results/planner-chunked-cpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from head_memory import BATCH, SEQ, llama_config  # the same model and batch


def run_one(
    vocab: int,
    precision: str,
    chunked: bool,
    compiled: bool = False,
    seq: int = SEQ,
    profiles: dict | None = None,
) -> dict:
    """One row (`seq` tokens a sequence: the test takes fewer than the table). The
    second step is measured (the first makes AdamW's state and the compiled graphs), as
    planner_memory.py does; `profiles` keeps the planner's profile of each vocabulary
    (and compiled precision) for the next row."""
    from transformers import LlamaForCausalLM

    import meshfit as mf
    from meshfit.planner.memory_probe import measure_peak, profiled_peak
    from meshfit.planner.search import profile_of

    config = llama_config(vocab)
    torch.manual_seed(0)
    plan = f"dp=1,precision={precision}"
    engine = mf.parallelize(
        LlamaForCausalLM(config),
        plan,
        loss_fn="model",
        chunked_loss=chunked,
        compile=compiled,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )
    ids = torch.randint(0, vocab, (BATCH, seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    engine.step(batch)  # AdamW's state, the compiled graphs
    if compiled:
        measured = profiled_peak(lambda: engine.step(batch))
    else:
        measured = measure_peak(lambda: engine.step(batch), engine=engine).total
    example = {k: v[:1] for k, v in batch.items()}
    key = (vocab, seq, precision if compiled else None)
    profiles = {} if profiles is None else profiles
    if key not in profiles:
        profiles[key] = profile_of(LlamaForCausalLM(config), example, "model", None, key[2])
    predicted = mf.estimate(
        profiles[key],
        plan,
        batch_size=BATCH,
        world_size=1,
        chunked_loss=chunked,
        compiled=compiled,
    )
    return {
        "vocab": vocab,
        "plan": plan,
        "chunked_loss": chunked,
        "compiled": compiled,
        "seq": seq,
        "measured_peak_bytes": measured,
        "predicted_bytes": predicted.memory.total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4,096-word vocabulary, 2 rows")
    parser.add_argument("--out", default=None, help="the JSON to write (default under results/)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cases = (
        [(4096, "bf16", c) for c in (False, True)]
        if args.quick
        else [(v, p, c) for v in (32000, 128256) for p in ("fp32", "bf16") for c in (False, True)]
        + [(128256, p, c, True) for p in ("fp32", "bf16") for c in (False, True)]
    )
    profiles: dict = {}
    rows = [run_one(*case, profiles=profiles) for case in cases]
    print("| vocabulary | plan | mode | logits | measured MiB | predicted MiB | off |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        off = r["predicted_bytes"] / r["measured_peak_bytes"] - 1
        print(
            f"| {r['vocab']:,} | `{r['plan']}` | {'compiled' if r['compiled'] else 'eager'} | "
            f"{'in chunks' if r['chunked_loss'] else 'whole'} | "
            f"{r['measured_peak_bytes'] / 2**20:.1f} | {r['predicted_bytes'] / 2**20:.1f} | "
            f"{off:+.1%} |"
        )
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "planner-chunked-cpu.json")
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "planner-chunked",
                "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
                "batch": BATCH,
                "seq": SEQ,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
