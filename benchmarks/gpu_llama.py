"""A Hugging Face Llama of 1.24B parameters trained through `mf.fit` unchanged, on one GPU:
tokens/s and MFU, eager and compiled (issue 16: "the same table for a Hugging Face
Llama-style model of about 1B parameters built from a config and trained through fit").

Model: LlamaForCausalLM built from a config shaped as Llama 3.2 1B (gpu_fp8.py's
LLAMA_1B: width 2048, 16 layers, 32 heads of which 8 key/value, MLP 8192, vocabulary
128,256, tied embeddings), no download. Data: what a collator yields, a dict of
`input_ids`, `attention_mask` and `labels` per sample (random tokens: only speed is
measured here; gpu_fp8.py has the learnable data and the loss curves), the model's own
loss (`loss_fn="model"`), bf16 autocast over fp32 master weights, fused AdamW.

MFU here: the FLOPs of gpu_fp8.flops_per_token over the bf16 matrix-product rate measured
in the same run (gpu_throughput.matmul_tflops), beside the MFU fit itself logs (against
the preset's datasheet peak, hardware.py).

    python benchmarks/gpu_llama.py                   # eager and compiled, batch 4 x 2048
    python benchmarks/gpu_llama.py --modes compile --batch-size 8
    python benchmarks/gpu_llama.py --quick           # tiny Llama: a smoke test (CPU ok)

Writes JSON to benchmarks/results/gpu-llama-<gpu>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
from gpu_fp8 import LLAMA_1B, TINY, adamw, flops_per_token, make_model
from gpu_throughput import matmul_tflops

import meshfit as mf


class CollatedTokens(torch.utils.data.Dataset):
    """Samples as a tokenizer + collator pipeline yields them (fixed length, no padding)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def run(fields: dict, args: argparse.Namespace, compiled: bool, device: torch.device) -> dict:
    model = make_model(fields, "cpu")  # fit moves it
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.warmup + args.steps
    data = CollatedTokens(steps * args.batch_size, args.seq, fields["vocab_size"])
    start = time.perf_counter()
    history = mf.fit(
        model,
        data,
        plan="precision=bf16",
        loss_fn="model",
        optimizer=adamw,
        batch_size=args.batch_size,
        max_steps=steps,
        log_every=args.log_every,
        shuffle=False,
        progress=False,
        compile=compiled,
        report_memory=True,
    )
    wall = time.perf_counter() - start
    # fit logs a rate every log_every steps; the ones after the warm-up are the steady state
    steady = [r for r in history.records if r["step"] > args.warmup and r.get("tokens_per_s")]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady) if steady else None
    logged_mfu = [r["mfu"] for r in steady if "mfu" in r]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, history
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {
        "mode": "compile" if compiled else "eager",
        "params": n_params,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token(n_params, fields, args.seq),
        "fit_logged_mfu": statistics.median(logged_mfu) if logged_mfu else None,
        "peak_gib": peak,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=40, help="steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fields = LLAMA_1B
    if args.quick:
        fields, args.batch_size, args.seq = TINY, 2, 32
        args.steps, args.warmup, args.log_every = 4, 2, 2
    peak_tflops = matmul_tflops(device) if not args.quick else matmul_tflops(device, n=256)
    rows = []
    for mode in args.modes.split(","):
        row = run(fields, args, mode == "compile", device)
        if row["tokens_per_s"]:
            row["mfu_vs_measured_peak"] = (
                row["tokens_per_s"] * row["flops_per_token"] / (peak_tflops * 1e12)
            )
        rows.append(row)
        print(json.dumps(row))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "benchmark": "gpu-llama",
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "matmul_tflops_bf16": peak_tflops,
        "batch_size": args.batch_size,
        "seq": args.seq,
        "quick": args.quick,
        "rows": rows,
    }
    slug = name.lower().replace(" ", "-")
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"gpu-llama-{slug}{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"| mode | tokens/s | MFU (measured peak {peak_tflops:.0f} TFLOP/s) | MFU fit logged | peak GiB |"
    )
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        mfu = r.get("mfu_vs_measured_peak")
        print(
            f"| {r['mode']} | {r['tokens_per_s'] or 0:,.0f} | {mfu * 100 if mfu else 0:.1f}% | "
            f"{(r['fit_logged_mfu'] or 0) * 100:.1f}% | {r['peak_gib'] or 0:.1f} |"
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
