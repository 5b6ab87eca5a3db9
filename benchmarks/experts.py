"""Mixtures of experts on 4 CPU workers: experts placed whole (ep=4), split by tensor
parallel (tp=4), or replicated (dp=4). Per rank: the bytes of expert parameters it holds,
the step time (median of 3 after one warm-up step), and the bytes it sent per step, read
from the loopback interface's counter (/proc/net/dev "lo": what crossed the wire, headers
included; all workers run here, so every byte on "lo" is one rank sending to another).

The model is a transformers Qwen3-MoE (width 512, 4 layers, 16 experts of width 512,
top-2, 8 query heads over 4 key/value heads, vocabulary 1024), float32 with its default
experts kernel (torch._grouped_mm), AdamW; a global batch of 8 sequences of 128 tokens.

    python benchmarks/experts.py            # about 5 minutes on 2 cores
    python benchmarks/experts.py --quick    # a smoke test

Writes benchmarks/results/experts-cpu.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import meshfit as mf

WIDTH, LAYERS, EXPERTS, TOP_K, VOCAB, LENGTH, BATCH = 512, 4, 16, 2, 1024, 128, 8


def qwen3_moe(width: int, layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
            head_dim=width // 8, moe_intermediate_size=width, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, max_position_embeddings=LENGTH,
        )
    )  # fmt: skip


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    return {"input_ids": ids, "labels": ids}


def loopback_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def worker(plan: str, width: int, layers: int) -> dict:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = qwen3_moe(width, layers)
    engine = mf.parallelize(
        model, plan, loss_fn="model", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4)
    )
    engine.step(batch(0))  # warm-up: probes, the optimizer's state
    times, sent = [], []
    for step in range(1, 4):
        dist.barrier()
        before = loopback_tx_bytes()
        start = time.perf_counter()
        engine.step(batch(step))
        dist.barrier()
        times.append(time.perf_counter() - start)
        sent.append(loopback_tx_bytes() - before)
    held = 0
    for p in engine.parallel_model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if _is_expert(p):
            held += local.numel() * local.element_size()
    return {
        "plan": plan,
        "expert_bytes_per_rank": held,
        "step_s": statistics.median(times),
        # every rank's sends are on "lo": the counter's delta over the world is per rank
        "sent_bytes_per_rank": statistics.median(sent) / dist.get_world_size(),
    }


def _is_expert(p: torch.Tensor) -> bool:
    """A parameter of shape (experts, ...): fused experts, placed (a DTensor on "ep"),
    split by tp (a DTensor whose full shape leads with the experts) or whole."""
    return p.ndim >= 3 and p.shape[0] == EXPERTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    width, layers = (64, 2) if args.quick else (WIDTH, LAYERS)
    rows = []
    for plan in ("dp=4", "tp=4", "dp=4,ep=4"):
        row = mf.launch(worker, nproc=4, args=(plan, width, layers))
        rows.append(row)
        print(
            f"{plan:>10}: experts {row['expert_bytes_per_rank'] / 1e6:7.1f} MB/rank  step "
            f"{row['step_s']:6.2f} s  sent {row['sent_bytes_per_rank'] / 1e6:7.1f} MB/rank/step",
            flush=True,
        )
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"experts-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "experts",
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "model": {
                    "width": width,
                    "layers": layers,
                    "experts": EXPERTS,
                    "top_k": TOP_K,
                    "vocab": VOCAB,
                },
                "batch": [BATCH, LENGTH],
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
