"""Gradient-norm clipping over sharded gradients (DTensor): time per call on CPU workers.

Compares three ways of getting the whole model's gradient norm under fsdp=2,tp=2, where
each parameter's gradient is a DTensor: one collective per parameter (what meshfit did
first), one per kind of gradient layout (what meshfit does now), and PyTorch's own
`torch.nn.utils.clip_grad_norm_` where it accepts the gradients. All must agree.

    python benchmarks/grad_clip.py              # 4 workers, 12-block GPT (about a minute)
    python benchmarks/grad_clip.py --quick      # smoke test: checks the script works

Prints a table last and writes JSON to benchmarks/results/grad-clip-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned workers import us

import meshfit as mf  # noqa: E402
from meshfit.models import GPT, GPTConfig, next_token_loss  # noqa: E402
from meshfit.parallel.grad_norm import clip_grad_norm  # noqa: E402

NO_CLIP = 1e30  # a max_norm that never scales: every call sees the same gradients


def per_parameter_norm(params: list) -> torch.Tensor:
    squares = []
    for p in params:
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # one collective per parameter
        squares.append(norm * norm)
    return torch.stack(squares).sum().sqrt()


def torch_norm(params: list) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(params, NO_CLIP)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


RUNNERS = {
    "one collective per parameter": per_parameter_norm,
    "meshfit (one per layout)": lambda params: clip_grad_norm(params, NO_CLIP),
    "torch clip_grad_norm_": torch_norm,
}


def worker(config: GPTConfig, plan: str, calls: int) -> dict:
    torch.manual_seed(0)
    engine = mf.parallelize(GPT(config), plan, loss_fn=next_token_loss)
    tokens = torch.randint(0, config.vocab_size, (8, config.block_size + 1))
    next_token_loss(engine.parallel_model(tokens[:, :-1]), tokens[:, 1:]).backward()
    params = [p for p in engine.parallel_model.parameters() if p.grad is not None]
    rows = {}
    for name, norm_of in RUNNERS.items():
        try:
            norm = float(norm_of(params))  # warm-up, and the value to compare
        except Exception as error:  # noqa: BLE001 - reported in the table, not raised
            rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
            continue
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            norm_of(params)
            times.append(time.perf_counter() - start)
        rows[name] = {"norm": norm, "median_ms": statistics.median(times) * 1e3}
    return {"parameters": len(params), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--plan", default="fsdp=2,tp=2")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per way")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=args.layers, n_head=4, n_embd=64)
    if args.quick:
        args.plan, args.calls = "tp=2", 2
        config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    plan = mf.Plan.parse(args.plan)
    nproc = (plan.dp or 1) * plan.fsdp * plan.tp * plan.pp
    result = mf.launch(worker, nproc=nproc, args=(config, args.plan, args.calls))
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"grad-clip-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "grad-clip",
                "plan": args.plan,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "config": vars(config),
                "calls": args.calls,
                **result,
            },
            f,
            indent=1,
        )
    print(f"plan {args.plan}, {result['parameters']} gradients per rank; results in {out}")
    print(f"{'way':<30} {'median ms':>10} {'norm':>12}")
    for name, row in result["rows"].items():
        if "error" in row:
            print(f"{name:<30} {'refused':>10}  {row['error']}")
        else:
            print(f"{name:<30} {row['median_ms']:>10.1f} {row['norm']:>12.6f}")


if __name__ == "__main__":
    main()
