"""Context parallel: the per-rank peak of one training step against sequence length.

A transformers Llama (width 256, 4 layers, 8 query heads over 2 key/value heads,
vocabulary 512, float32), one sequence per step and its own loss, on CPU workers (gloo,
one thread each), for cp = 1, 2 and 4 at 1,024 to 16,384 tokens. Per rank: the peak of
live tensor bytes during the second step (meshfit's planner/memory_probe.py, the first
step holds the cp probe), split into model state and the rest (activations, the
attention mask, gathered keys and values, temporaries); the planner's prediction of the
same (`mf.estimate`, the model profiled on meta at that length); the step's time; the
bytes cp's own collectives were handed (K/V gathers forward, their gradients' sums
backward, the positions the mask is built from) against the formula
layers x 2 x S x kv_width x 4 B forward, the same backward.

    python benchmarks/context_memory.py             # about 10 minutes on 2 cores
    python benchmarks/context_memory.py --quick     # a smoke test (seconds)

Writes benchmarks/results/context-memory-cpu.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as dist

import meshfit as mf

WIDTH, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 4, 8, 2, 512


def llama(length: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=length, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def batch(length: int) -> dict:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(1, VOCAB, (1, length), generator=g)
    return {"input_ids": ids, "labels": ids}


class Handed:
    """Bytes handed to torch's all-gathers and all-reduces while counting (DDP's
    gradient all-reduce runs in C++ and is not seen: it is the same under every cp)."""

    def __init__(self) -> None:
        self.counting, self.gathered, self.reduced = False, 0, 0
        self.originals = {
            n: getattr(dist, n) for n in ("all_gather_single", "all_gather", "all_reduce")
        }

        def gather_single(out, x, *a, **k):
            if self.counting:
                self.gathered += out.numel() * out.element_size()
            return self.originals["all_gather_single"](out, x, *a, **k)

        def gather(parts, x, *a, **k):
            if self.counting:
                self.gathered += sum(p.numel() * p.element_size() for p in parts)
            return self.originals["all_gather"](parts, x, *a, **k)

        def reduce(t, *a, **k):
            if self.counting:
                self.reduced += t.numel() * t.element_size()
            return self.originals["all_reduce"](t, *a, **k)

        dist.all_gather_single, dist.all_gather, dist.all_reduce = gather_single, gather, reduce


def worker(lengths: list[int], cp: int) -> list[dict]:
    from meshfit.planner.memory_probe import measure_peak

    warnings.simplefilter("ignore")
    handed = Handed()
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        plan = f"cp={cp}" if cp > 1 else None
        engine = mf.parallelize(llama(length), plan, loss_fn="model")
        data = batch(length)
        engine.step(data)  # the first step: the probe, the optimizer's state made
        handed.counting, handed.gathered, handed.reduced = True, 0, 0
        start = time.perf_counter()
        peak = measure_peak(lambda: engine.step(data), engine=engine)  # noqa: B023
        seconds = time.perf_counter() - start
        handed.counting = False
        row = {
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "length": length,
            "cp": cp,
            "peak_bytes": peak.total,
            "model_state_bytes": peak.parameters + peak.gradients + peak.optimizer,
            "other_bytes": peak.other,
            "step_s": seconds,
            "gathered_bytes": handed.gathered,
            "reduced_bytes": handed.reduced,
        }
        if dist.is_initialized():
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, row)
            rows.append(max(everyone, key=lambda r: r["peak_bytes"]))  # the fullest rank
        else:
            rows.append(row)
    return rows


def predicted(length: int, cp: int) -> dict:
    """mf.estimate of the same step (the model on meta, profiled at `length`)."""
    from meshfit.plan import Plan

    with torch.device("meta"):
        model = llama(length)
    ids = torch.zeros(1, length, dtype=torch.long)
    e = mf.estimate(
        model, Plan(dp=1, cp=cp), batch_size=1, example_inputs={"input_ids": ids},
        loss_fn="model", example_targets=None, hardware="cpu", optimizer="adamw",
    )  # fmt: skip
    m = e.memory
    return {
        "total": m.total,
        "activations": m.activations,
        "model_state": m.parameters + m.gradients + m.optimizer,
    }


def kv_formula(length: int, cp: int) -> int:
    """Bytes cp's collectives are handed per step: K and V of every layer gathered
    (the whole sequence's, float32) forward, their gradients summed backward."""
    if cp == 1:
        return 0
    return LAYERS * 2 * length * KV_HEADS * (WIDTH // HEADS) * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequences: a smoke test")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths = [256, 512] if args.quick else [1024, 2048, 4096, 8192, 16384]
    rows = []
    for cp in (1, 2, 4):
        if cp == 1:
            torch.set_num_threads(1)
            got = worker(lengths, 1)
        else:
            got = mf.launch(worker, nproc=cp, args=(lengths, cp))  # rank 0 returns all
        for row in got:
            row["predicted"] = predicted(row["length"], cp)
            row["kv_formula_bytes"] = kv_formula(row["length"], cp)
            rows.append(row)
            print(_line(row), flush=True)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"context-memory-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "context-memory",
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "model": {
                    "width": WIDTH,
                    "layers": LAYERS,
                    "heads": HEADS,
                    "kv_heads": KV_HEADS,
                    "vocab": VOCAB,
                },
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"results in {out}")


def _line(r: dict) -> str:
    mb = 1e6
    p = r["predicted"]
    return (
        f"S={r['length']:>6} cp={r['cp']}  peak {r['peak_bytes'] / mb:8.1f} MB "
        f"(rest {r['other_bytes'] / mb:8.1f}; predicted {p['total'] / mb:8.1f}, activations "
        f"{p['activations'] / mb:8.1f})  step {r['step_s']:6.2f} s  K/V handed "
        f"{r['gathered_bytes'] / mb:6.1f} + {r['reduced_bytes'] / mb:6.1f} MB "
        f"(formula {r['kv_formula_bytes'] / mb:6.1f} each)"
    )


if __name__ == "__main__":
    main()
