"""fp8 against bf16 on one GPU: tokens/s and the loss curve of a ~1B Llama-style model.

Model: a Hugging Face LlamaForCausalLM built from a config (no download), shaped as
Llama 3.2 1B: width 2048, 16 layers, 32 heads (8 key/value heads), MLP 8192, vocabulary
128,256, tied embeddings: 1.24B parameters. It trains through meshfit unchanged
(`mf.parallelize(model, "precision=bf16" | "precision=fp8")`, fused AdamW, compile=True:
torchao's float8 casts need torch.compile to pay, as torchtitan says), the same seed and
the same batches for both precisions.

Data: learnable, made here (a run on random tokens has a flat loss curve, which would
compare nothing): every sequence follows a fixed random order-2 Markov chain over the
whole vocabulary (each pair of previous tokens has 8 possible successors, with Zipf
weights), so the loss falls from ln(128256) = 11.8 towards the chain's entropy.

What it reports, per precision: tokens/s over the steps after --warmup (no host sync
inside the window), MFU against the bf16 matmul peak measured in the same run (fp8's too,
as torchtitan reports it), peak memory, and the loss at every step. Then fp8's speed-up
over bf16 (issue 16's target: 1.25x or more) and whether fp8's loss tracks bf16's: the
mean loss of every window of 20 steps after the first 20 within LOSS_RTOL (3%, the bound
the CPU test of the emulated path uses, tests/test_precision_fp8.py) of bf16's.

    python benchmarks/gpu_fp8.py                     # 300 steps each, batch 4 x 2048
    python benchmarks/gpu_fp8.py --steps 500 --batch-size 8
    python benchmarks/gpu_fp8.py --dry-run           # the runs it would do, then stop
    python benchmarks/gpu_fp8.py --quick             # tiny Llama; on CPU fp8 is emulated
    python benchmarks/gpu_fp8.py --chunked-loss      # mf.losses.cross_entropy() with
                                                     # chunked_loss=True, both precisions
    python benchmarks/gpu_fp8.py --precisions bf16,fp8,fp8:rowwise,fp8+head,fp8:rowwise+head
        # issue 50's levers: each fp8 row against the one bf16 row; "fp8:<recipe>" sets
        # fp8_recipe (tensorwise, rowwise, rowwise_with_gw_hp), "+head" fp8_head=True

Writes JSON to benchmarks/results/gpu-fp8-<gpu>.json. fp8 needs a GPU of CUDA
capability 8.9 or later (H100, H200, L4, L40) and pip install 'meshfit[fp8]'.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

import meshfit as mf

LOSS_RTOL = 0.03  # fp8 against bf16, per 20-step window mean (see the docstring)
WINDOW = 20
SUCCESSORS = 8  # of each pair of tokens, in the synthetic chain

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
# Widths that are multiples of 16, so that fp8 converts the blocks' Linears here too.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def llama_config(fields: dict):
    from transformers import LlamaConfig

    config = LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    return config


def make_model(fields: dict, device: torch.device | str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(llama_config(fields))


def next_token_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def adamw(params):
    params = list(params)
    return torch.optim.AdamW(params, lr=3e-4, fused=all(p.is_cuda for p in params) or None)


class Chain:
    """A fixed order-2 Markov chain over the vocabulary: the synthetic language."""

    def __init__(self, vocab: int, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g).to(device)
        weights = 1.0 / torch.arange(1, SUCCESSORS + 1, dtype=torch.float)
        self.weights = (weights / weights.sum()).to(device)
        self.device = device

    def entropy(self) -> float:
        """Nats per token of the chain: the loss a perfect model reaches."""
        return float(-(self.weights * self.weights.log()).sum())

    def batch(self, size: int, length: int, g: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(size, length + 1, dtype=torch.long)
        tokens[:, :2] = torch.randint(0, self.vocab, (size, 2), generator=g)
        choice = torch.multinomial(self.weights.cpu(), size * (length + 1), True, generator=g)
        choice = choice.view(size, length + 1)
        table = self.table.cpu()
        for t in range(2, length + 1):
            key = (tokens[:, t - 1] * 31 + tokens[:, t - 2]) % self.vocab
            tokens[:, t] = table[key, choice[:, t]]
        return tokens.to(self.device)


def flops_per_token(n_params: int, fields: dict, seq: int) -> float:
    """6 per matmul parameter (the embedding lookup not counted; the tied LM head is)
    plus attention's 12 * layers * width * context (PaLM's convention)."""
    lookup = fields["vocab_size"] * fields["hidden_size"]  # a tied table counts as the head
    matmul = n_params - (0 if fields["tie_word_embeddings"] else lookup)
    return 6 * matmul + 12 * fields["num_hidden_layers"] * fields["hidden_size"] * seq


def fp8_variant(label: str) -> tuple[str, dict]:
    """("fp8", parallelize's fp8 options) of a row label such as "fp8:rowwise+head";
    (label, {}) for another precision."""
    if not label.startswith("fp8"):
        return label, {}
    head = label.endswith("+head")
    recipe = label.removesuffix("+head").partition(":")[2] or "tensorwise"
    return "fp8", {"fp8_recipe": recipe, "fp8_head": head}


def run(label, fields, batches, device, warmup, compile, chunked=False) -> dict:
    precision, levers = fp8_variant(label)
    model = make_model(fields, device)
    engine = mf.parallelize(
        model,
        mf.Plan(dp=1, precision=precision),
        optimizer=adamw,
        loss_fn=mf.losses.cross_entropy() if chunked else next_token_loss,
        compile=compile,
        chunked_loss=chunked,
        **levers,
    )
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    losses = []
    start = time.perf_counter()
    for i, batch in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        losses.append(engine.step(batch).detach())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    timed = len(batches) - warmup
    return {
        "precision": label,
        **levers,
        "float8_linears": converted,
        "timed_steps": timed,
        "step_s": seconds / timed,
        "peak_gib": peak,
        "losses": [float(x) for x in losses],
    }


def compare_losses(fp8: list[float], bf16: list[float]) -> dict:
    windows = []
    for start in range(WINDOW, len(bf16) - WINDOW + 1, WINDOW):
        a = statistics.fmean(fp8[start : start + WINDOW])
        b = statistics.fmean(bf16[start : start + WINDOW])
        windows.append({"from_step": start, "fp8": a, "bf16": b, "rel": abs(a - b) / b})
    worst = max((w["rel"] for w in windows), default=float("nan"))
    return {"windows": windows, "worst_rel": worst, "within": worst <= LOSS_RTOL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--dry-run", action="store_true", help="say what would run, then stop")
    parser.add_argument("--steps", type=int, default=300, help="steps per precision")
    parser.add_argument("--warmup", type=int, default=20, help="steps before timing starts")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--precisions", default="bf16,fp8", help="comma list")
    parser.add_argument("--no-compile", action="store_true", help="eager (fp8 is slow so)")
    parser.add_argument(
        "--chunked-loss",
        action="store_true",
        help="the LM head and loss a chunk of tokens at a time (chunked_loss=True)",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="start no row after this many seconds"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    began = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fields = TINY if args.quick else LLAMA_1B
    if args.quick:
        args.steps, args.warmup, args.batch_size, args.seq = 2 * WINDOW + 2, 2, 2, 16
        args.no_compile = True
    precisions = args.precisions.split(",")
    from meshfit.parallel.fp8 import EMULATE_ENV, has_fp8_hardware

    emulated = any(p.startswith("fp8") for p in precisions) and not has_fp8_hardware(device)
    if emulated and args.quick:
        os.environ[EMULATE_ENV] = "1"  # only the smoke test: torchao's emulation
    n_params = sum(p.numel() for p in make_model(fields, "meta").parameters())
    per_token = flops_per_token(n_params, fields, args.seq)
    tokens_per_step = args.batch_size * args.seq
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}: Llama {n_params / 1e6:,.0f}M params, {per_token / 1e9:.2f} GFLOP/token, "
        f"{tokens_per_step} tokens/step, {args.steps} steps ({args.warmup} untimed) each "
        f"of {', '.join(precisions)}, {'eager' if args.no_compile else 'compiled'}"
        + (" (fp8 emulated: no fp8 hardware)" if emulated and args.quick else "")
    )
    if args.dry_run:
        return
    if emulated and not args.quick:
        raise SystemExit(
            f"fp8 needs a GPU of CUDA capability 8.9 or later; {name} has none "
            f"(--quick emulates it, for a smoke test only)"
        )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # only the fp32 leftovers use it
    from gpu_throughput import matmul_tflops

    peak_tflops = matmul_tflops(device, n=512 if args.quick else 8192)
    chain = Chain(fields["vocab_size"], device)
    g = torch.Generator().manual_seed(0)
    data = [chain.batch(args.batch_size, args.seq, g) for _ in range(args.steps)]
    batches = [(t[:, :-1], t[:, 1:]) for t in data]

    rows = []
    for precision in precisions:
        if args.deadline_s and time.perf_counter() - began > args.deadline_s:
            print(f"skipped {precision}: past --deadline-s", flush=True)
            continue
        row = run(
            precision, fields, batches, device, args.warmup, not args.no_compile, args.chunked_loss
        )
        row["tokens_per_s"] = tokens_per_step / row["step_s"]
        row["mfu_vs_bf16_peak"] = row["tokens_per_s"] * per_token / (peak_tflops * 1e12)
        rows.append(row)
        print(
            f"  {precision}: {row['tokens_per_s']:.0f} tokens/s, MFU {row['mfu_vs_bf16_peak']:.1%}"
            f", loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}, "
            f"{row['float8_linears']} Float8Linear",
            flush=True,
        )
        if args.out:  # each row as it ends, in case the run is cut short
            with open(args.out + ".partial", "w") as f:
                json.dump(rows, f, default=str)
    by = {r["precision"]: r for r in rows}
    summary = {}
    if "bf16" in by and "fp8" in by:
        summary = {
            "speedup": by["fp8"]["tokens_per_s"] / by["bf16"]["tokens_per_s"],
            "loss": compare_losses(by["fp8"]["losses"], by["bf16"]["losses"]),
        }
    if "bf16" in by:  # every fp8 variant against bf16 ("fp8" also above, as before)
        summary["variants"] = {
            label: {
                "speedup": row["tokens_per_s"] / by["bf16"]["tokens_per_s"],
                "loss": compare_losses(row["losses"], by["bf16"]["losses"]),
            }
            for label, row in by.items()
            if label.startswith("fp8")
        }
        for label, v in summary["variants"].items():
            print(
                f"  {label} over bf16: {v['speedup']:.3f}x, worst window "
                f"{v['loss']['worst_rel']:.2%}"
            )
    result = {
        "benchmark": "gpu-fp8",
        "device_name": name,
        "torch": torch.__version__,
        "torchao": _version("torchao"),
        "transformers": _version("transformers"),
        "date": time.strftime("%Y-%m-%d"),
        "config": fields,
        "params": n_params,
        "flops_per_token": per_token,
        "matmul_tflops_bf16": peak_tflops,
        "batch_size": args.batch_size,
        "seq": args.seq,
        "tokens_per_step": tokens_per_step,
        "steps": args.steps,
        "warmup": args.warmup,
        "compiled": not args.no_compile,
        "chunked_loss": args.chunked_loss,
        "fp8_emulated": emulated,
        "chain_entropy": chain.entropy(),
        "initial_loss_expected": math.log(fields["vocab_size"]),
        "loss_rtol": LOSS_RTOL,
        "quick": args.quick,
        "rows": rows,
        "summary": summary,
    }
    slug = name.lower().replace(" ", "-")
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"gpu-fp8-{slug}{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"results in {out}")
    if summary:
        loss = summary["loss"]
        print(
            f"fp8 / bf16 tokens/s: {summary['speedup']:.3f} (target >= 1.25); loss windows "
            f"worst {loss['worst_rel']:.2%} apart (tolerance {LOSS_RTOL:.0%}): "
            f"{'within' if loss['within'] else 'OUTSIDE'}"
        )


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
