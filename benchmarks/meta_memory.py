"""Peak memory per rank while the engine is built: a model built on meta against the same
model built on the CPU first (issue 30's "build/load peak" target: at most the full model
over the ranks that split it, plus the largest single tensor, plus 10%).

For each plan, its CPU workers (2 or 4; gloo, one thread each) build meshfit's GPT either way and
`meshfit.planner.memory_probe.measure_peak` counts live tensor storage over `mf.parallelize`
(the model built on the CPU is alive before the call and counts from its start). Also
with `weights=`: the model on meta, loading a safetensors file of it.

    python benchmarks/meta_memory.py            # GPT of 25M parameters
    python benchmarks/meta_memory.py --quick    # a tiny one (the test suite's smoke test)
    python benchmarks/meta_memory.py --plans "tp=2;fsdp=2,tp=2"   # some plans only

Prints a Markdown table and writes benchmarks/results/meta-memory-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss
from meshfit.planner.memory_probe import measure_peak

CONFIG = GPTConfig(vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_embd=512, bias=False)
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, bias=False)
PLANS = ["fsdp=2", "pp=2", "tp=2", "dp=2", "dp=1", "fsdp=4", "fsdp=2,tp=2"]
QUICK_PLANS = PLANS[:4]  # the smoke test: two workers only


def build_peak(config: GPTConfig, plan: str, how: str, weights: str | None) -> dict:
    """On every worker: this rank's peak of live tensor bytes while parallelize builds the
    engine, for the model built `how` ("cpu", "meta", "meta+weights")."""
    torch.manual_seed(0)
    holder: dict = {}
    if how == "cpu":
        model = GPT(config)
    else:
        with torch.device("meta"):
            model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    options = {"init": model.init_passes()} if how == "meta" else {}
    if how == "meta+weights":
        options["weights"] = weights
    if "pp=" in plan:
        options["example_inputs"] = tokens

    def build() -> None:
        holder["engine"] = mf.parallelize(model, plan, loss_fn=next_token_loss, **options)

    modules = [model] if how == "cpu" else []  # the CPU-built model counts from the start
    peak = measure_peak(build, modules=modules)
    engine = holder["engine"]
    kept = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for p in engine.parallel_model.parameters()
    )
    mine = {"peak": peak.total, "kept_params": kept}
    if not torch.distributed.is_initialized():  # one process
        return {"plan": plan, "how": how, "ranks": [mine]}
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, mine)
    return {"plan": plan, "how": how, "ranks": values}


def _processes(plan: str) -> int:
    """The workers `plan` runs on: the product of its degrees."""
    parsed = mf.Plan.parse(plan)
    return (parsed.dp or 1) * parsed.fsdp * parsed.tp * parsed.pp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT: a smoke test")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plans", default=None, help="';'-separated plans (default: all)")
    args = parser.parse_args()
    config = TINY if args.quick else CONFIG
    torch.manual_seed(0)
    reference = GPT(config)
    model_bytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in reference.state_dict().values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        weights = os.path.join(tmp, "model.safetensors")
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, weights)
        chosen = args.plans.split(";") if args.plans else QUICK_PLANS if args.quick else PLANS
        for plan in chosen:
            for how in ("cpu", "meta", "meta+weights"):
                start = time.perf_counter()
                nproc = _processes(plan)
                row = mf.launch(build_peak, nproc=nproc, args=(config, plan, how, weights))
                row["seconds"] = time.perf_counter() - start
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nmodel: {model_bytes / 2**20:.1f} MiB fp32, largest tensor {largest / 2**20:.2f} MiB")
    # The target per rank (issue 30): what it keeps of the model, plus the largest single
    # tensor, plus 10%; under dp, DDP's gradient buckets (a second copy of the model,
    # made when DDP is built) come on top.
    print("| plan | built | peak per rank (MiB), rank 0 / rank 1 / ... | target (MiB) |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        targets = []
        for r in row["ranks"]:
            kept = r["kept_params"] * 4  # fp32
            buckets = kept if row["plan"].startswith("dp") and len(row["ranks"]) > 1 else 0
            targets.append(1.1 * (kept + largest) + buckets)
        peaks = " / ".join(f"{r['peak'] / 2**20:.1f}" for r in row["ranks"])
        target = " / ".join(f"{t / 2**20:.1f}" for t in targets)
        print(f"| `{row['plan']}` | {row['how']} | {peaks} | {target} |")
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"meta-memory-cpu{'-quick' if args.quick else ''}.json",
    )
    with open(out, "w") as f:
        json.dump({"model_bytes": model_bytes, "largest": largest, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
