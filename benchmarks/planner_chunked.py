"""The planner's memory with `chunked_loss=True` against a measured step, on the CPU.

A transformers LlamaForCausalLM built from a config (width 256, 2 layers, 4 heads of
which 2 key/value, MLP 512, untied head: the model of benchmarks/head_memory.py), its own
loss (`loss_fn="model"`, a collator's dict), AdamW, batch 4 x 512 tokens, one process:
float32 and bf16 autocast, a 32,000- and a 128,256-word vocabulary, the logits whole and
in chunks, eager; and at 128k words compiled (`compile=True`). With `--plans`, the 128k
float32 rows under tp=2 (the head split over the vocabulary: each rank's chunks over its
half of the words) and pp=2 (the head and its chunks on the last stage) on 2 CPU workers
(gloo, one thread each), the fullest rank against the estimate for world size 2. Each
row's second step is measured (eager: `memory_probe.measure_peak`, live tensor bytes at
the peak; compiled: `profiled_peak`, torch.profiler's memory profile, which sees
Inductor's allocations) beside `mf.estimate(..., chunked_loss=..., compiled=...)` for the same plan.
On a CPU where torch has no bf16 matrix products (no AVX-512) the bf16 rows' products are
zeros of their shape, not computed (zero_products.py: the same peaks, in minutes not an
hour); the JSON says which.

    python benchmarks/planner_chunked.py           # 12 rows, about 3 minutes on 2 cores
    python benchmarks/planner_chunked.py --quick   # a 4,096-word vocabulary, 2 rows
    python benchmarks/planner_chunked.py --plans   # tp=2 and pp=2 on 2 workers, 4 rows

Writes benchmarks/results/planner-chunked-cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os

import torch
from head_memory import BATCH, SEQ, llama_config  # the same model and batch
from zero_products import products_as_zeros

from meshfit.runtime.precision import bf16_products_are_native


def _batch(vocab: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def measured_step(
    vocab: int,
    plan: str,
    chunked: bool,
    compiled: bool = False,
    seq: int = SEQ,
    zeros: bool | None = None,
) -> int:
    """This rank's peak bytes in the second step of the Llama under `plan` (the first
    makes AdamW's state and the compiled graphs), as planner_memory.py measures. `zeros`:
    the bf16 products left uncomputed (zero_products.py; by default where this CPU has
    no bf16 products of its own)."""
    from transformers import LlamaForCausalLM

    import meshfit as mf
    from meshfit.planner.memory_probe import measure_peak, profiled_peak

    config = llama_config(vocab)
    torch.manual_seed(0)
    batch = _batch(vocab, seq)
    options = {"example_inputs": {k: v[:1] for k, v in batch.items()}} if "pp=" in plan else {}
    engine = mf.parallelize(
        LlamaForCausalLM(config),
        plan,
        loss_fn="model",
        chunked_loss=chunked,
        compile=compiled,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        **options,
    )
    if zeros is None:
        zeros = "precision=bf16" in plan and not bf16_products_are_native()
    products = products_as_zeros(compiled) if zeros else contextlib.nullcontext()
    with products:
        engine.step(batch)  # AdamW's state, the compiled graphs
        gc.collect()
        if compiled:
            return profiled_peak(lambda: engine.step(batch))
        return measure_peak(lambda: engine.step(batch), engine=engine).total


def predicted_peak(
    vocab: int,
    plan: str,
    chunked: bool,
    compiled: bool,
    seq: int,
    profiles: dict,
    world_size: int = 1,
    precision: str | None = None,
) -> int:
    """mf.estimate's peak for the same step; `profiles` keeps the planner's profile of
    each vocabulary (and compiled precision) for the next row."""
    from transformers import LlamaForCausalLM

    import meshfit as mf
    from meshfit.planner.search import profile_of

    key = (vocab, seq, precision if compiled else None)
    if key not in profiles:
        example = {k: v[:1] for k, v in _batch(vocab, seq).items()}
        profiles[key] = profile_of(
            LlamaForCausalLM(llama_config(vocab)), example, "model", None, key[2]
        )
    return mf.estimate(
        profiles[key],
        plan,
        batch_size=BATCH,
        world_size=world_size,
        chunked_loss=chunked,
        compiled=compiled,
    ).memory.total


def _row(vocab, plan, chunked, compiled, seq, measured, predicted) -> dict:
    return {
        "vocab": vocab,
        "plan": plan,
        "chunked_loss": chunked,
        "compiled": compiled,
        "seq": seq,
        "measured_peak_bytes": measured,
        "predicted_bytes": predicted,
    }


def run_one(
    vocab: int,
    precision: str,
    chunked: bool,
    compiled: bool = False,
    seq: int = SEQ,
    profiles: dict | None = None,
) -> dict:
    """One row in this process (`seq` tokens a sequence: the test takes fewer than the
    table)."""
    plan = f"dp=1,precision={precision}"
    measured = measured_step(vocab, plan, chunked, compiled, seq)
    profiles = {} if profiles is None else profiles
    predicted = predicted_peak(vocab, plan, chunked, compiled, seq, profiles, 1, precision)
    return _row(vocab, plan, chunked, compiled, seq, measured, predicted)


def _plans_worker(cases: list[tuple[int, str, bool]], seq: int) -> list[int]:
    """Each case's peak on the fullest rank (one launch for every case)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    peaks = []
    for vocab, plan, chunked in cases:
        peak = torch.tensor(measured_step(vocab, plan, chunked, seq=seq))
        gc.collect()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks.append(int(peak))
    return peaks


def run_plans(cases: list[tuple[int, str, bool]], seq: int = SEQ, profiles=None) -> list[dict]:
    """Rows of 2-worker plans (eager, float32), all in one launch of 2 CPU workers."""
    import meshfit as mf

    measured = mf.launch(_plans_worker, nproc=2, args=(cases, seq))  # rank 0 returns
    profiles = {} if profiles is None else profiles
    return [
        _row(v, plan, c, False, seq, peak, predicted_peak(v, plan, c, False, seq, profiles, 2))
        for (v, plan, c), peak in zip(cases, measured, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4,096-word vocabulary, 2 rows")
    parser.add_argument(
        "--plans", action="store_true", help="tp=2 and pp=2 on 2 workers (128k, float32)"
    )
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
    if args.plans:
        plans = ("tp=2", "pp=2,microbatches=2")
        rows = run_plans([(128256, p, c) for p in plans for c in (False, True)], profiles=profiles)
    else:
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
    name = "planner-chunked-plans-cpu.json" if args.plans else "planner-chunked-cpu.json"
    out = args.out or os.path.join(os.path.dirname(__file__), "results", name)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "planner-chunked",
                "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
                "batch": BATCH,
                "seq": SEQ,
                "bf16_products": "computed" if bf16_products_are_native() else "zeros",
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
