"""GPU throughput: a ~400M-parameter GPT in bf16, hand-written loop vs meshfit, with MFU.

Model: meshfit's GPT with d=1024, 24 layers, 16 heads, context 1024, GPT-2's padded
vocabulary (50,304), no biases: 405M parameters. bf16 autocast over fp32 master
weights, fused AdamW, random tokens already on the GPU (so the data path is not timed).

MFU's denominator is measured here, in the same run, on the same GPU: the rate of an
8192 x 8192 x 8192 bf16 matrix product. The numerator counts 6 FLOPs per parameter per
token for the matrix multiplies (token and position embeddings are lookups, not counted;
the LM head is) plus attention's 12 * layers * width * context per token (PaLM's
convention, which counts the causal mask's skipped half as done).

    python benchmarks/gpu_throughput.py                  # eager and compiled, both loops
    python benchmarks/gpu_throughput.py --modes compile  # one mode
    python benchmarks/gpu_throughput.py --quick          # tiny model: a smoke test (CPU ok)

Prints a table last and writes JSON to benchmarks/results/gpu-throughput-<gpu>.json.
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

GPT_400M = GPTConfig(
    vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024, bias=False
)
TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 dense matrix-multiply rate: MFU's denominator."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def flops_per_token(model: GPT) -> float:
    c = model.config
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    matmul_params = sum(p.numel() for p in model.parameters()) - embeddings
    return 6 * matmul_params + 12 * c.n_layer * c.n_embd * c.block_size


def make_model(config: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(device)


def adamw(params):
    params = list(params)
    return torch.optim.AdamW(params, lr=3e-4, fused=all(p.is_cuda for p in params) or None)


class HandLoop:
    """What a careful user writes without meshfit: autocast, fused AdamW, no host sync."""

    def __init__(self, config, device, precision, compile):
        self.model = make_model(config, device)
        self.optimizer = adamw(self.model.parameters())
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        self.device = device

        def forward_loss(x, y):
            return next_token_loss(self.model(x), y)

        self.forward_loss = torch.compile(forward_loss) if compile else forward_loss

    def step(self, batch):
        x, y = batch
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.forward_loss(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class MeshfitLoop:
    def __init__(self, config, device, precision, compile):
        plan = mf.Plan(dp=1, precision=precision)
        self.engine = mf.parallelize(
            make_model(config, device),
            plan,
            optimizer=adamw,
            loss_fn=next_token_loss,
            compile=compile,
        )

    def step(self, batch):
        return self.engine.step(batch)


RUNNERS = {"hand-written": HandLoop, "meshfit engine": MeshfitLoop}


def timed(runner, batches, device) -> float:
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        runner.step(batch)
    sync(device)
    return time.perf_counter() - start


def run_mode(mode, config, batches, device, precision, rounds, warmup) -> list[dict]:
    compile = mode == "compile"
    runners = {}
    for name, cls in RUNNERS.items():
        runners[name] = cls(config, device, precision, compile)
        start = time.perf_counter()
        timed(runners[name], batches[:warmup], device)  # compiles, autotunes, allocates
        print(f"  {mode:<8} {name:<15} warm-up {time.perf_counter() - start:6.1f} s", flush=True)
    times = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):  # alternate, so drift in clocks hits both alike
        for name in names[r % 2 :] + names[: r % 2]:
            times[name].append(timed(runners[name], batches, device))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del runners
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return [
        {
            "mode": mode,
            "runner": name,
            "step_s": statistics.median(t) / len(batches),
            "all_s": t,
            "peak_gib_both_models": peak,
        }
        for name, t in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TINY if args.quick else GPT_400M
    if args.quick:
        args.batch_size, args.steps, args.rounds, args.warmup = 2, 2, 1, 1
        args.modes = "eager"
    precision = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # only the fp32 leftovers use it

    peak_tflops = matmul_tflops(device, n=512 if args.quick else 8192)
    probe = GPT(config)
    n_params = sum(p.numel() for p in probe.parameters())
    per_token = flops_per_token(probe)
    del probe
    tokens_per_step = args.batch_size * config.block_size
    g = torch.Generator().manual_seed(0)
    data = torch.randint(
        0, config.vocab_size, (args.steps, args.batch_size, config.block_size + 1), generator=g
    ).to(device)
    batches = [(t[:, :-1], t[:, 1:]) for t in data]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}: measured matmul {peak_tflops:.0f} TFLOP/s; model {n_params / 1e6:.0f}M "
        f"params, {per_token / 1e9:.2f} GFLOP/token, {tokens_per_step} tokens/step"
    )

    rows = []
    for mode in args.modes.split(","):
        rows += run_mode(mode, config, batches, device, precision, args.rounds, args.warmup)
    for row in rows:
        row["tokens_per_s"] = tokens_per_step / row["step_s"]
        row["mfu"] = row["tokens_per_s"] * per_token / (peak_tflops * 1e12)
        hand = next(r for r in rows if r["mode"] == row["mode"] and r["runner"] == "hand-written")
        row["vs_hand"] = hand["step_s"] / row["step_s"]

    result = {
        "benchmark": "gpu-throughput",
        "device_name": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "config": vars(config),
        "params": n_params,
        "flops_per_token": per_token,
        "matmul_tflops": peak_tflops,
        "batch_size": args.batch_size,
        "tokens_per_step": tokens_per_step,
        "precision": precision,
        "steps": args.steps,
        "rounds": args.rounds,
        "quick": args.quick,
        "rows": rows,
    }
    slug = name.lower().replace(" ", "-")
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"gpu-throughput-{slug}{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"results in {out}")
    print(f"{'mode':<8} {'runner':<15} {'step ms':>8} {'tokens/s':>10} {'MFU':>6} {'vs hand':>8}")
    for r in rows:
        print(
            f"{r['mode']:<8} {r['runner']:<15} {r['step_s'] * 1e3:>8.1f} "
            f"{r['tokens_per_s']:>10.0f} {r['mfu']:>6.1%} {r['vs_hand']:>8.3f}"
        )


if __name__ == "__main__":
    main()
