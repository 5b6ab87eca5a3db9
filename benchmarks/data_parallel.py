"""Data parallel on N CPU workers (gloo): hand-written loops vs meshfit, and the bytes each
rank sends per step against theory, for replicas (DDP, dp=N) and shards (FSDP2, fsdp=N).

Theory, with P the model's fp32 bytes: DDP's ring all-reduce of the gradients sends at
least 2(N-1)/N x P per rank and step; ZeRO-3 / FSDP sends 3(N-1)/N x P (an all-gather
of the parameters in forward, another in backward, a reduce-scatter of the gradients).

Bytes are read from the loopback interface's counter (/proc/net/dev, "lo"), so they are
what really crossed the wire (TCP/IP headers included), not what was asked for. All
workers run on this machine, so every byte on "lo" is one rank sending to another.

    python benchmarks/data_parallel.py              # 2 workers, demo GPT (a few minutes)
    python benchmarks/data_parallel.py --quick      # smoke test: checks the script works
    python benchmarks/data_parallel.py --pipeline   # dp / fsdp next to pp=2: bytes only

Prints a table last and writes JSON to benchmarks/results/data-parallel-cpu.json.
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
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # spawned workers import us

import meshfit as mf  # noqa: E402
from meshfit.launch.process_group import init_distributed  # noqa: E402
from meshfit.models import GPT, GPTConfig, next_token_loss  # noqa: E402


def loopback_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])  # transmit bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def run_hand(config, batches, rank, world):
    """What a user writes with DDP by hand: shard the batch, forward, backward, step."""
    return _hand_step(DistributedDataParallel(_model(config)), batches, rank, world)


def _hand_step(model, batches, rank, world):
    """One step of a hand-written loop: this rank's share of the batch, forward,
    backward (the wrapper syncs gradients), optimizer step."""
    optimizer = _optimizer(model.parameters())
    share = len(batches[0][0]) // world

    def step(x, y):
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        next_token_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_meshfit(config, batches, rank, world):
    return _meshfit_step(config, f"dp={world}")


def _meshfit_step(config, plan):
    engine = mf.parallelize(_model(config), plan, optimizer=_optimizer, loss_fn=next_token_loss)
    return lambda x, y: engine.step((x, y))


def run_hand_fsdp(config, batches, rank, world):
    """FSDP2 by hand: one unit per block and one for the rest (the root), as usual."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(config)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _hand_step(model, batches, rank, world)


def run_meshfit_fsdp(config, batches, rank, world):
    return _meshfit_step(config, f"fsdp={world}")


RUNNERS = {
    "hand-written DDP": run_hand,
    "meshfit dp=N": run_meshfit,
    "hand-written FSDP2": run_hand_fsdp,
    "meshfit fsdp=N": run_meshfit_fsdp,
}
# Bytes each rank must send per step, in units of (N-1)/N x the model's bytes.
THEORY = {"hand-written DDP": 2, "meshfit dp=N": 2, "hand-written FSDP2": 3, "meshfit fsdp=N": 3}


def collective_bytes(numel: int = 2**20, repeats: int = 3) -> dict[str, float]:
    """Bytes each rank sends for one collective, as a fraction of the tensor's bytes
    (theory for a ring: all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N)."""
    world = dist.get_world_size()
    whole, part = torch.ones(numel), torch.empty(numel // world)
    ops = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, whole),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, part),
    }
    fractions = {}
    for name, op in ops.items():
        op()
        dist.barrier()
        before = loopback_tx_bytes()
        for _ in range(repeats):
            op()
        dist.barrier()
        fractions[name] = (loopback_tx_bytes() - before) / world / repeats / (numel * 4)
    return fractions


def worker(config: GPTConfig, steps: int, rounds: int, batch_size: int) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_distributed()  # the process group the hand-written DDP uses too
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (steps, batch_size, config.block_size + 1), generator=g
    )
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    steppers = {name: build(config, batches, rank, world) for name, build in RUNNERS.items()}
    for step in steppers.values():  # warm-up
        step(*batches[0])
    times = {name: [] for name in steppers}
    sent = {name: [] for name in steppers}
    names = list(steppers)
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            dist.barrier()
            before = loopback_tx_bytes()
            start = time.perf_counter()
            for x, y in batches:
                steppers[name](x, y)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            # Both barriers add a few hundred bytes; negligible against the gradients.
            sent[name].append((loopback_tx_bytes() - before) / world / steps)
    grad_bytes = sum(p.numel() * p.element_size() for p in _model(config).parameters())
    return {
        "times": times,
        "bytes_per_rank_per_step": sent,
        "gradient_bytes": grad_bytes,
        "collectives": collective_bytes(),
    }


PIPELINE_PLANS = [
    f"{dp},pp=2,microbatches={m}{extra}"
    for dp, extra in (("dp=2", ""), ("fsdp=2", ""), ("fsdp=2", ",reshard_after_forward=false"))
    for m in (2, 8)
]


def pipeline_worker(config: GPTConfig, plan: str, steps: int, batch_size: int) -> float:
    """Bytes this plan's ranks send per rank and step (after a first, untimed step)."""
    torch.manual_seed(0)
    engine = mf.parallelize(GPT(config), plan, loss_fn=next_token_loss)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (steps + 1, batch_size, config.block_size + 1), generator=g
    )
    engine.step((tokens[0, :, :-1], tokens[0, :, 1:]))
    dist.barrier()
    before = loopback_tx_bytes()
    for t in tokens[1:]:
        engine.step((t[:, :-1], t[:, 1:]))
    dist.barrier()
    return (loopback_tx_bytes() - before) / dist.get_world_size() / steps


def pipeline_main(args: argparse.Namespace) -> None:
    """--pipeline: replicas or shards next to pp=2 (4 workers), bytes only."""
    config = GPTConfig(n_layer=4)
    rows = [
        {
            "plan": plan,
            "bytes_per_rank_per_step": mf.launch(
                pipeline_worker, nproc=4, args=(config, plan, args.steps, args.batch_size)
            ),
        }
        for plan in PIPELINE_PLANS
    ]
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "data-parallel-pipeline-cpu.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "data-parallel-pipeline",
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "config": vars(config),
                "steps": args.steps,
                "batch_size": args.batch_size,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"4 CPU workers (gloo), GPT with 4 blocks, batch {args.batch_size}; results in {out}")
    for r in rows:
        print(f"{r['plan']:<48} {r['bytes_per_rank_per_step'] / 1e6:>8.3f} MB/rank/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="bytes of dp / fsdp next to pp=2 on 4 workers instead",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.pipeline:
        args.steps = min(args.steps, 3)
        return pipeline_main(args)
    config = GPTConfig()
    if args.quick:
        config = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)
        args.steps, args.rounds, args.batch_size = 2, 1, 4
    result = mf.launch(
        worker, nproc=args.nproc, args=(config, args.steps, args.rounds, args.batch_size)
    )
    n = args.nproc
    ring_min = 2 * (n - 1) / n * result["gradient_bytes"]
    rows = []
    for name in RUNNERS:
        # meshfit is compared with the hand-written loop of its own kind.
        kind = "FSDP2" if "fsdp" in name.lower() else "DDP"
        hand = statistics.median(result["times"][f"hand-written {kind}"])
        median = statistics.median(result["times"][name])
        sent = statistics.median(result["bytes_per_rank_per_step"][name])
        theory = THEORY[name] * (n - 1) / n * result["gradient_bytes"]
        rows.append(
            {
                "runner": name,
                "median_s": median,
                "samples_per_s": args.steps * args.batch_size / median,
                "vs_hand": hand / median,
                "bytes_per_rank_per_step": sent,
                "theory_bytes": theory,
                "vs_theory": sent / theory,
                "all_s": result["times"][name],
            }
        )
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"data-parallel-cpu{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "data-parallel",
                "nproc": n,
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "config": vars(config),
                "gradient_bytes": result["gradient_bytes"],
                "ring_minimum_bytes": ring_min,
                "steps": args.steps,
                "rounds": args.rounds,
                "batch_size": args.batch_size,
                "collective_bytes_fraction": result["collectives"],
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(
        f"{n} CPU workers (gloo), model {result['gradient_bytes'] / 1e6:.2f} MB, theory per "
        f"rank and step: DDP 2(N-1)/N, FSDP 3(N-1)/N of it; results in {out}"
    )
    probe = ", ".join(f"{k} {v:.3f}" for k, v in result["collectives"].items())
    print(f"bytes sent per rank for one collective, per byte of the tensor: {probe}")
    print(
        f"{'runner':<18} {'median s':>9} {'samples/s':>10} {'vs hand':>8} {'MB/rank/step':>13} "
        f"{'theory MB':>10} {'vs theory':>10}"
    )
    for r in rows:
        print(
            f"{r['runner']:<18} {r['median_s']:>9.3f} {r['samples_per_s']:>10.1f} {r['vs_hand']:>8.3f} "
            f"{r['bytes_per_rank_per_step'] / 1e6:>13.3f} {r['theory_bytes'] / 1e6:>10.3f} "
            f"{r['vs_theory']:>10.3f}"
        )


if __name__ == "__main__":
    main()
