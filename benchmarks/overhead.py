"""Overhead on one device: a hand-written PyTorch loop vs meshfit's engine vs mf.fit.

Same model (the demo GPT), batch, optimizer and precision in all three; runs alternate
(hand, engine, fit, hand, ...) so drift in the machine's speed hits all of them alike.

    python benchmarks/overhead.py                 # full run (a few minutes on 2 cores)
    python benchmarks/overhead.py --quick         # smoke test: checks the script works

Prints a table last and writes the full results as JSON beside this file
(benchmarks/results/overhead-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss


def make_model(config: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(device)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hand(config, batches, device) -> float:
    """The loop a user would write without meshfit."""
    model = make_model(config, device)
    optimizer = make_optimizer(model.parameters())
    sync(device)
    start = time.perf_counter()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = next_token_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def run_engine(config, batches, device) -> float:
    engine = mf.parallelize(
        make_model(config, device), "dp=1", optimizer=make_optimizer, loss_fn=next_token_loss
    )
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        engine.step(batch)
    sync(device)
    return time.perf_counter() - start


def run_fit(config, batches, device) -> float:
    inputs = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    sync(device)
    start = time.perf_counter()
    mf.fit(
        make_model(config, device),
        (inputs, targets),
        plan="dp=1",
        loss_fn=next_token_loss,
        optimizer=make_optimizer,
        batch_size=len(batches[0][0]),
        max_steps=len(batches),
        shuffle=False,
        progress=False,
        log_every=10,
    )
    sync(device)
    return time.perf_counter() - start


RUNNERS = {"hand-written": run_hand, "meshfit engine": run_engine, "meshfit fit": run_fit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="JSON path (default: results/ beside this)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        config = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)
        args.rounds, args.steps, args.batch_size = 1, 3, 4
    else:
        config = GPTConfig()  # the demo GPT: 4 layers, width 128, context 128

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (args.steps, args.batch_size, config.block_size + 1), generator=g
    )
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    for runner in RUNNERS.values():  # warm-up: allocator, kernels, imports
        runner(config, batches[:2], device)

    times: dict[str, list[float]] = {name: [] for name in RUNNERS}
    names = list(RUNNERS)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            times[name].append(RUNNERS[name](config, batches, device))

    samples = args.steps * args.batch_size
    hand = statistics.median(times["hand-written"])
    rows = []
    for name in names:
        median = statistics.median(times[name])
        # Paired: each round's hand-written time over this runner's in the same round
        # (adjacent runs share the machine's state of the moment), then the median.
        paired = [h / t for h, t in zip(times["hand-written"], times[name], strict=True)]
        rows.append(
            {
                "runner": name,
                "median_s": median,
                "samples_per_s": samples / median,
                "throughput_vs_hand": hand / median,
                "paired_vs_hand": statistics.median(paired),
                "paired_range": [min(paired), max(paired)],
                "all_s": times[name],
            }
        )
    result = {
        "benchmark": "overhead",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "config": vars(config) if hasattr(config, "__dict__") else str(config),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "quick": args.quick,
        "rows": rows,
    }
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"overhead-{device.type}{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)

    print(
        f"overhead on {device} ({torch.get_num_threads()} threads), {args.rounds} rounds x {args.steps} steps, batch {args.batch_size}; results in {out}"
    )
    print(f"{'runner':<16} {'median s':>9} {'samples/s':>10} {'vs hand':>8} {'paired':>7}")
    for row in rows:
        print(
            f"{row['runner']:<16} {row['median_s']:>9.3f} {row['samples_per_s']:>10.1f} "
            f"{row['throughput_vs_hand']:>8.3f} {row['paired_vs_hand']:>7.3f} "
            f"({row['paired_range'][0]:.3f}-{row['paired_range'][1]:.3f})"
        )


if __name__ == "__main__":
    main()
