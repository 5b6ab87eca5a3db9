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
in the same run (gpu_throughput.matmul_tflops), beside the MFU fit itself logs, which is
given the same peak (MESHFIT_PEAK_FLOPS; without it fit divides by the preset's
datasheet peak, hardware.py): the two then differ only by their FLOP counts.

    python benchmarks/gpu_llama.py                   # eager and compiled, batch 4 x 2048
    python benchmarks/gpu_llama.py --modes compile --batch-size 8
    python benchmarks/gpu_llama.py --quick           # tiny Llama: a smoke test (CPU ok)
    python benchmarks/gpu_llama.py --modes compile --rows whole:4,chunked:4,chunked:8
                                                     # the LM head and loss whole or in chunks
                                                     # (chunked_loss=True), at batch 4 and 8
    python benchmarks/gpu_llama.py --modes compile --rows whole:4:cudnn,whole:4:flash
                                                     # attention's kernel forced (sdpa_kernel):
                                                     # cudnn, flash, efficient or math
    python benchmarks/gpu_llama.py --modes compile --rows chunked:4 --memory
                                                     # what is alive at the step's memory peak
                                                     # (memory_timeline.py), two steps recorded

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
from memory_timeline import PeakAllocations

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


def run(
    fields: dict,
    args: argparse.Namespace,
    compiled: bool,
    device: torch.device,
    batch_size: int,
    chunked: bool,
    attention: str = "default",
) -> dict:
    model = make_model(fields, "cpu")  # fit moves it
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.warmup + args.steps
    data = CollatedTokens(steps * batch_size, args.seq, fields["vocab_size"])
    # the profile covers 3 steps of the last logged window (the median of the windows'
    # rates is what the row reports, so one slowed window does not move it)
    callbacks: list = []
    if args.profile and device.type == "cuda":
        callbacks.append(KernelProfile(steps - 4, steps - 1))
    memory = PeakAllocations(args.warmup, args.warmup + 2) if args.memory else None
    if memory is not None:
        callbacks.append(memory)
    start = time.perf_counter()
    with _attention_kernel(attention):
        history = mf.fit(
            model,
            data,
            plan="precision=bf16",
            loss_fn="model",
            optimizer=adamw,
            batch_size=batch_size,
            max_steps=steps,
            log_every=args.log_every,
            shuffle=False,
            progress=False,
            compile=compiled,
            report_memory=True,
            chunked_loss=chunked,
            callbacks=callbacks,
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
        "loss": "chunked" if chunked else "whole",
        "batch_size": batch_size,
        "params": n_params,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token(n_params, fields, args.seq),
        "fit_logged_mfu": statistics.median(logged_mfu) if logged_mfu else None,
        "peak_gib": peak,
        "wall_s": wall,
        "attention": attention,
        "profile": next((c.shares for c in callbacks if isinstance(c, KernelProfile)), None),
        "memory_at_peak": memory.summary if memory is not None else None,
    }


def _attention_kernel(name: str):
    """The context that forces scaled_dot_product_attention's kernel ("default": torch's
    own choice; on the CPU every name is the default)."""
    import contextlib

    if name == "default" or not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel([backends[name]])


# What a kernel's name says it does (CUDA kernels of cuBLAS, flash attention, fused AdamW
# and Inductor's Triton kernels); the first pattern that matches wins.
KERNEL_KINDS = (
    ("matrix products", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("adam", "multi_tensor")),
    ("fused elementwise (Triton)", ("triton",)),
    ("copies", ("memcpy", "memset", "copy")),
)


class KernelProfile(mf.Callback):
    """torch.profiler over steps [first, last): the GPU's time by kind of kernel, as
    shares of the steps' wall time (what is left is the GPU idle: host work, launches)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.prof = None
        self.began = 0.0
        self.shares: dict | None = None

    def on_step_begin(self, step: int, engine) -> None:
        if step == self.first:
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.began = time.perf_counter()
        elif step == self.last and self.prof is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.began
            self.prof.__exit__(None, None, None)
            kinds: dict[str, float] = {}
            for event in self.prof.key_averages():
                us = getattr(event, "self_device_time_total", 0) or 0
                name = event.key.lower()
                kind = next(
                    (k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other"
                )
                kinds[kind] = kinds.get(kind, 0.0) + us / 1e6
            busy = sum(kinds.values())
            self.shares = {k: v / wall for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
            self.shares["GPU idle"] = max(0.0, 1 - busy / wall)
            self.shares["wall_s_per_step"] = wall / (self.last - self.first)
            print(
                f"profile, steps {self.first}-{self.last - 1}: {json.dumps(self.shares)}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument(
        "--rows",
        default=None,
        help="comma list of LOSS:BATCH[:ATTENTION] (LOSS whole or chunked: chunked_loss=True; "
        "ATTENTION default, cudnn, flash, efficient or math); default whole:<--batch-size>",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="start no row after this many seconds"
    )
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=40, help="steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="GPU time by kernel kind (CUDA)")
    parser.add_argument(
        "--memory", action="store_true", help="what is alive at the memory peak (CUDA)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fields = LLAMA_1B
    if args.quick:
        fields, args.batch_size, args.seq = TINY, 2, 32
        args.steps, args.warmup, args.log_every = 4, 2, 2
    peak_tflops = matmul_tflops(device) if not args.quick else matmul_tflops(device, n=256)
    if device.type == "cuda":  # fit's logged MFU over the same peak as this table's
        from meshfit.planner.mfu import PEAK_ENV

        os.environ[PEAK_ENV] = str(peak_tflops * 1e12)
    began = time.perf_counter()
    wanted = [r.split(":") for r in (args.rows or f"whole:{args.batch_size}").split(",")]
    rows = []
    for mode, (loss, batch, *kernel) in ((m, w) for m in args.modes.split(",") for w in wanted):
        attention = kernel[0] if kernel else "default"
        if attention not in ("default", "cudnn", "flash", "efficient", "math"):
            raise SystemExit(f"unknown attention kernel {attention!r} in --rows")
        if args.deadline_s and time.perf_counter() - began > args.deadline_s:
            print(f"skipped {mode} {loss}:{batch}: past --deadline-s", flush=True)
            continue
        batch_size = 2 if args.quick else int(batch)
        row = run(fields, args, mode == "compile", device, batch_size, loss == "chunked", attention)
        if row["tokens_per_s"]:
            row["mfu_vs_measured_peak"] = (
                row["tokens_per_s"] * row["flops_per_token"] / (peak_tflops * 1e12)
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(args, device, peak_tflops, rows)
    _table(peak_tflops, rows)


def _write(args: argparse.Namespace, device: torch.device, peak_tflops: float, rows: list) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "benchmark": "gpu-llama",
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "matmul_tflops_bf16": peak_tflops,
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
    print(f"results in {out}", flush=True)


def _table(peak_tflops: float, rows: list) -> None:
    print(
        f"| mode | LM head and loss | batch | attention | tokens/s | MFU (measured peak "
        f"{peak_tflops:.0f} TFLOP/s) | MFU fit logged | peak GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mfu = r.get("mfu_vs_measured_peak")
        print(
            f"| {r['mode']} | {r['loss']} | {r['batch_size']} | {r['attention']} | "
            f"{r['tokens_per_s'] or 0:,.0f} | "
            f"{mfu * 100 if mfu else 0:.1f}% | {(r['fit_logged_mfu'] or 0) * 100:.1f}% | "
            f"{r['peak_gib'] or 0:.1f} |"
        )


if __name__ == "__main__":
    main()
