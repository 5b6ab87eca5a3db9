"""The planner against one GPU: predicted vs measured step time and peak memory.

For meshfit's benchmark GPT at several sizes (125M, 405M, 1.3B; bf16 autocast, fused
AdamW, context 1024), with and without recomputation, eager and compiled, this trains a
few steps through `mf.parallelize` in one process and compares the step time (median of
the timed steps) and `torch.cuda.max_memory_allocated` with `mf.estimate(...,
hardware=this_machine())` for the same plan (issue 12's targets: time within 15%,
memory within 10%).

    python benchmarks/planner_gpu.py            # every row (about 5 minutes on one H100)
    python benchmarks/planner_gpu.py --quick    # a tiny model, runs on CPU too: a smoke test
    python benchmarks/planner_gpu.py --again benchmarks/results/planner-gpu-nvidia-h200.json
        # no GPU: today's planner against the rows a GPU measured (the H200 preset)

Prints a Markdown table and writes benchmarks/results/planner-gpu-<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss
from meshfit.planner import estimate, this_machine

SIZES = {
    "125M": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False),
    "405M": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024, bias=False),
    "1.3B": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=2048, bias=False),
}  # fmt: skip
TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)


def run_one(config: GPTConfig, plan: str, batch: int, compiled: bool, steps: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.device("meta"):
        meta_model = GPT(config)
    hw = this_machine(1)
    predicted = estimate(
        meta_model,
        plan,
        batch_size=batch,
        example_inputs=inputs[:1].cpu(),
        hardware=hw,
        compiled=compiled,
        world_size=1,
    )
    engine = mf.parallelize(
        model,
        plan,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=device.type == "cuda"),
        loss_fn=next_token_loss,
        compile=compiled,
    )
    for _ in range(3):  # warm-up: compilation, allocator, optimizer state
        engine.step((inputs, targets))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step((inputs, targets))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "plan": plan,
        "batch": batch,
        "compiled": compiled,
        "measured_step_s": statistics.median(times),
        "predicted_step_s": predicted.step_time.total,
        "measured_peak_bytes": peak,
        "predicted_bytes": predicted.memory.total,
        "hardware": hw.source,
    }


def predict_again(path: str) -> list[dict]:
    """The rows of an earlier run, their measurements kept, predicted by today's planner
    with the hardware preset of the GPU that measured them."""
    from meshfit.planner.hardware import hardware

    with open(path) as f:
        earlier = json.load(f)
    # "NVIDIA H200" (or a row's "preset for NVIDIA H200") -> the h200 preset
    device = earlier.get("device") or earlier["rows"][0]["hardware"]
    hw = hardware(device.split()[-1].lower())
    rows = []
    for row in earlier["rows"]:
        config = SIZES[row["model"]]
        with torch.device("meta"):
            meta_model = GPT(config)
        predicted = estimate(
            meta_model,
            row["plan"],
            batch_size=row["batch"],
            example_inputs=torch.zeros(1, config.block_size, dtype=torch.long),
            hardware=hw,
            compiled=row["compiled"],
            world_size=1,
        )
        rows.append(
            row
            | {
                "predicted_step_s": predicted.step_time.total,
                "predicted_bytes": predicted.memory.total,
                "hardware": hw.source,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one row (CPU ok)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="the JSON to write (default under results/)")
    parser.add_argument(
        "--again", default=None, help="an earlier run's JSON: predict its rows again"
    )
    args = parser.parse_args()
    if args.again:
        _print_table(predict_again(args.again))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    rows = []
    cases = [("tiny", TINY, "dp=1", 4, False)] if args.quick else [
        (name, config, f"dp=1,precision=bf16{ckpt}", batch, compiled)
        for name, config in SIZES.items()
        for ckpt, batch in (("", 8), (",checkpointing=full", 16))
        for compiled in (False, True)
    ]  # fmt: skip
    for name, config, plan, batch, compiled in cases:
        row = {"model": name, **run_one(config, plan, batch, compiled, args.steps)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    _print_table(rows)
    name = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"planner-gpu-{name}.json")
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "planner-gpu",
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "rows": rows,
            },
            f,
            indent=1,
        )


def _print_table(rows: list[dict]) -> None:
    print("\n| model | plan | batch | compiled | step measured / predicted (ms) | off | "
          "peak memory measured / predicted (GiB) | off |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t_off = 100 * (r["predicted_step_s"] / r["measured_step_s"] - 1)
        mem = "-"
        m_off = "-"
        if r["measured_peak_bytes"]:
            mem = f"{r['measured_peak_bytes'] / 2**30:.2f} / {r['predicted_bytes'] / 2**30:.2f}"
            m_off = f"{100 * (r['predicted_bytes'] / r['measured_peak_bytes'] - 1):+.0f}%"
        print(
            f"| {r['model']} | {r['plan']} | {r['batch']} | {r['compiled']} | "
            f"{r['measured_step_s'] * 1e3:.1f} / {r['predicted_step_s'] * 1e3:.1f} | "
            f"{t_off:+.0f}% | {mem} | {m_off} |"
        )


if __name__ == "__main__":
    main()
