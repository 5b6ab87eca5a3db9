"""The planner's memory and FLOPs for a mixture of experts against a measured step: what
`mf.estimate` predicts for expert parallel (ep), beside dp, fsdp, tp and pp, checked on
CPU workers as benchmarks/planner_memory.py checks the dense GPT.

The model is a transformers Qwen3-MoE from its own config (CONFIG below: width 128, 2
layers, 8 experts of width 96, top-2; its default experts kernel, torch._grouped_mm),
float32, AdamW, its own loss (`labels`); a global batch of 8 sequences of 64 tokens. The
second step is measured (the first makes AdamW's state) with
`meshfit.planner.memory_probe.measure_peak` on every rank; the planner's peak for the
fullest rank comes from `mf.estimate` on the same model and batch. One-process plans run
here, the others on CPU workers started with `mf.launch` (gloo, one thread each), every
plan of one world size in one launch.

The FLOPs: a forward's count under torch's FlopCounterMode against the planner's profile
(which adds the grouped products torch has no formula for: parallel/flop_counts.py) and
the count by hand (every matrix product of the model, attention without a causal saving
as the profile counts it).

    python benchmarks/planner_experts.py          # every plan (~25 s on 2 cores)
    python benchmarks/planner_experts.py --quick  # smoke test: one process

Writes benchmarks/results/planner_experts.json; prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings
from typing import Any

import planner_memory
import torch

import meshfit as mf
from meshfit.planner.memory_probe import measure_peak

CONFIG = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=96,
    num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
)  # fmt: skip
BATCH, LENGTH = 8, 64
LR = 3e-4  # AdamW, torch's defaults otherwise (one parameter at a time on the CPU)
MEASURED_STEP = 2
PLANS: list[tuple[str, int]] = [
    ("none", 1),
    ("dp=2", 2),
    ("dp=2,ep=2", 2),
    ("fsdp=2", 2),
    ("fsdp=2,ep=2", 2),
    ("tp=2", 2),
    ("pp=2,schedule=1f1b,microbatches=4", 2),
    ("dp=2,tp=2", 4),
    ("dp=2,tp=2,ep=2", 4),
    ("dp=2,fsdp=2,ep=4", 4),
    ("dp=2,pp=2,ep=2,schedule=1f1b,microbatches=4", 4),
]


def qwen3_moe(device: str = "cpu") -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device(device):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, LENGTH), generator=g)
    return {"input_ids": ids, "labels": ids}


def measure(plan: str, config: Any = None) -> dict:
    """This rank's peak during step MEASURED_STEP under `plan` (`config`: unused, the
    model is CONFIG's; planner_memory.run_all passes one)."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    engine = mf.parallelize(
        qwen3_moe(),
        None if plan == "none" else plan,
        loss_fn="model",
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
    )
    for step in range(1, MEASURED_STEP):
        engine.step(make_batch(step))
    batch = make_batch(MEASURED_STEP)
    gc.collect()
    peak = measure_peak(lambda: engine.step(batch), engine=engine)
    return {"rank": engine.rank, **peak.as_dict()}


def run_all(plans: list[tuple[str, int]]) -> dict[str, dict]:
    """{plan: the rank with the largest measured peak}: planner_memory.py's launches, this
    model's measure."""
    rows = planner_memory.run_all(plans, None, measure_fn=measure)
    return {r["plan"]: max(r["ranks"], key=lambda rank: rank["total"]) for r in rows}


def predicted(plans: list[tuple[str, int]]) -> dict[str, float]:
    """The planner's peak bytes on the fullest rank, per plan (the model on the CPU:
    torch._grouped_mm's meta kernel takes bf16 only, and this model is float32)."""
    from meshfit.planner import estimate, profile_model

    warnings.simplefilter("ignore")
    profile = profile_model(qwen3_moe(), make_batch(0), loss_fn="model")
    return {
        plan: estimate(
            profile, "dp=1" if plan == "none" else plan, batch_size=BATCH, world_size=nproc
        ).memory.total
        for plan, nproc in plans
    }


def flop_counts() -> dict[str, float]:
    """One forward's FLOPs: torch's FlopCounterMode, the planner's profile (which counts
    the CPU's attention kernel and the experts' grouped products, torch having no
    formula for either: parallel/flop_counts.py), and by hand."""
    from torch.utils.flop_counter import FlopCounterMode

    from meshfit.planner import profile_model

    warnings.simplefilter("ignore")
    model, batch = qwen3_moe(), make_batch(0)
    counts = {}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=batch["input_ids"])
    counts["torch"] = float(counter.get_total_flops())
    profile = profile_model(model, batch, loss_fn="model")
    parts = [profile.head, *profile.blocks, profile.tail]
    counts["planner"] = sum(p.flops for p in parts) * BATCH
    counts["planner_experts"] = sum(p.expert_flops for p in parts) * BATCH
    c, tokens = CONFIG, BATCH * LENGTH
    width, heads, kv, head = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]  # fmt: skip
    projections = 2 * width * (heads * head + 2 * kv * head) + 2 * heads * head * width
    attention = 4 * heads * head * LENGTH  # scores and values, per token (no causal saving)
    router = 2 * width * c["num_experts"]
    experts = c["num_experts_per_tok"] * 2 * 3 * width * c["moe_intermediate_size"]
    head_flops = 2 * width * c["vocab_size"]
    per_token = c["num_hidden_layers"] * (projections + attention + router + experts) + head_flops
    counts["by_hand"] = float(per_token * tokens)
    counts["experts_by_hand"] = float(c["num_hidden_layers"] * experts * tokens)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: one process")
    parser.add_argument("--nproc", type=int, default=None, help="run only plans of this size")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    plans = [(p, n) for p, n in PLANS if n == 1 or not args.quick]
    plans = [(p, n) for p, n in plans if args.nproc in (None, n)]
    start = time.perf_counter()
    measured = run_all(plans)
    seconds = time.perf_counter() - start
    guesses = predicted(plans)
    flops = flop_counts()
    rows = [
        {
            "plan": plan,
            "nproc": nproc,
            "largest_rank": measured[plan],
            "predicted_total": guesses[plan],
            "off": guesses[plan] / measured[plan]["total"] - 1,
        }
        for plan, nproc in plans
    ]
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"planner_experts{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "planner-experts",
                "model": {"transformers": "Qwen3MoeForCausalLM", **CONFIG},
                "batch": [BATCH, LENGTH],
                "dtype": "float32",
                "optimizer": f"AdamW(lr={LR})",
                "measured_step": MEASURED_STEP,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "seconds": round(seconds, 1),
                "flops_one_forward": flops,
                "plans": rows,
            },
            f,
            indent=1,
        )
    mb = 2**20
    print(
        f"forward FLOPs: torch's counter {flops['torch']:.4g}, the planner's {flops['planner']:.4g} "
        f"(experts {flops['planner_experts']:.4g}), by hand {flops['by_hand']:.4g} (experts "
        f"{flops['experts_by_hand']:.4g}); {out}"
    )
    print(f"{'plan':<46} {'rank':>4} {'measured':>8} {'planner':>8} {'off':>5}  (MiB)")
    for r in rows:
        big = r["largest_rank"]
        print(
            f"{r['plan']:<46} {big['rank']:>4} {big['total'] / mb:>8.2f} "
            f"{r['predicted_total'] / mb:>8.2f} {100 * r['off']:>+4.0f}%"
        )


if __name__ == "__main__":
    main()
