"""Issue 30's memory rows on a GPU: a 1.24B transformers Llama built on the CPU and moved,
built on meta, or built on meta with `weights=`, in one process on one GPU:
`torch.cuda.max_memory_allocated` while the engine is built, over the first training
steps, and while `engine.save_model` writes it; with the values checked across the three
(one process on the GPU is the only plan a one-GPU machine can run: NCCL refuses two
ranks on one GPU).

Each row runs in a worker of its own (`mf.launch`, one process), so its peaks and its
host resident peak (`ru_maxrss`, the whole worker) are its own. The rows, in order:

- `cpu`: LlamaForCausalLM built on the CPU (seed 0), then `mf.parallelize` moves it;
  two AdamW steps; `save_model` into a directory of 1 GB shards.
- `meta`: built under `torch.device("meta")`, initialised by meshfit (the model's own
  `_init_weights`, replayed one module at a time on the CPU with the seeded generator):
  its initial values and losses must equal the `cpu` row's.
- `meta+weights`: built on meta with `weights=` the `cpu` row's saved directory: its
  values must equal what the `cpu` row saved (after its two steps).

    python benchmarks/gpu_meta_memory.py            # the 1.24B Llama (about 2 minutes on an H200)
    python benchmarks/gpu_meta_memory.py --repeat-cpu  # and the cpu row again: GPU run-to-run noise
    python benchmarks/gpu_meta_memory.py --quick    # a tiny Llama: a smoke test (CPU ok)

Writes JSON to benchmarks/results/gpu-meta-memory-<gpu>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch
from gpu_fp8 import LLAMA_1B, TINY, adamw, llama_config

import meshfit as mf

GIB = 2**30


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """Per parameter: sum and sum of squares in float64, on its own device (the same data
    in the same order reduce to the same numbers, so equal fingerprints within a run of
    rows mean equal values, up to a collision no init makes)."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.detach()
            t = t.to_local() if hasattr(t, "to_local") else t
            d = t.double()
            out[name] = [float(d.sum()), float((d * d).sum())]
    return out


def _batch(fields: dict, batch_size: int, seq: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, fields["vocab_size"], (batch_size, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def one_row(fields: dict, how: str, weights: str | None, save_dir: str | None, args: dict) -> dict:
    """In the worker: build (`how`), two steps, save; peaks of each phase."""
    from transformers import LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    start = time.perf_counter()
    if how == "cpu":
        model = LlamaForCausalLM(llama_config(fields))
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(fields))
    constructed_s = time.perf_counter() - start
    options = {"weights": weights} if how == "meta+weights" else {}
    _reset(device)
    start = time.perf_counter()
    engine = mf.parallelize(model, "precision=bf16", loss_fn="model", optimizer=adamw, **options)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    row = {
        "how": how,
        "params": sum(p.numel() for p in model.parameters()),
        "construct_s": constructed_s,
        "build_s": time.perf_counter() - start,
        "build_peak": _peak(device),
        "initial": _fingerprint(engine.parallel_model),
    }
    _reset(device)
    losses = []
    for step in range(args["steps"]):
        losses.append(float(engine.step(_batch(fields, args["batch_size"], args["seq"], step))))
    row["losses"] = losses
    row["step_peak"] = _peak(device)
    row["trained"] = _fingerprint(engine.parallel_model)
    if save_dir is not None:
        _reset(device)
        if device.type == "cuda":  # the peak while saving starts from what training holds
            row["before_save"] = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        engine.save_model(save_dir, max_shard_size=args["max_shard_size"])
        row["save_s"] = time.perf_counter() - start
        row["save_peak"] = _peak(device)
        row["save_files"] = sorted(os.listdir(save_dir))
    # Linux reports ru_maxrss in KiB: the worker's whole life (imports, CPU build, init)
    row["host_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def _over(row: dict) -> str:
    """What saving added on the GPU to what it held before (GiB), or '-'."""
    if row.get("save_peak") is None or row.get("before_save") is None:
        return "-"
    return (
        f"{(row['save_peak'] - row['before_save']) / GIB:.3f} (of {row['before_save'] / GIB:.2f})"
    )


def _same(a: dict, b: dict) -> float:
    """The largest relative difference between two fingerprints (0.0: the same values)."""
    worst = 0.0
    for name, (s, q) in a.items():
        s2, q2 = b[name]
        worst = max(worst, abs(s - s2) / max(abs(s), 1e-30), abs(q - q2) / max(abs(q), 1e-30))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny Llama: a smoke test")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeat-cpu", action="store_true", help="the cpu row twice")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fields = LLAMA_1B
    knobs = {"steps": args.steps, "batch_size": args.batch_size, "seq": args.seq}
    knobs["max_shard_size"] = "1GB"
    if args.quick:
        fields = TINY
        knobs.update(batch_size=2, seq=32, max_shard_size="20KB")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "saved")
        todo = [("cpu", None, saved), ("meta", None, None), ("meta+weights", saved, None)]
        if args.repeat_cpu:  # the same run again: how far the GPU's own run-to-run noise goes
            todo.append(("cpu", None, None))
        for how, weights, save_dir in todo:
            start = time.perf_counter()
            row = mf.launch(one_row, nproc=1, args=(fields, how, weights, save_dir, knobs))
            row["wall_s"] = time.perf_counter() - start
            rows.append(row)
            brief = {k: v for k, v in row.items() if k not in ("initial", "trained")}
            print(json.dumps(brief), flush=True)
    cpu, meta, loaded = rows[:3]
    checks = {
        "meta initial values vs cpu (largest relative difference)": _same(
            cpu["initial"], meta["initial"]
        ),
        "meta losses vs cpu (largest absolute difference)": max(
            abs(a - b) for a, b in zip(cpu["losses"], meta["losses"], strict=True)
        ),
        "weights= values vs what cpu saved (largest relative difference)": _same(
            cpu["trained"], loaded["initial"]
        ),
    }
    if args.repeat_cpu:
        checks["cpu again vs cpu: losses (largest absolute difference)"] = max(
            abs(a - b) for a, b in zip(cpu["losses"], rows[3]["losses"], strict=True)
        )
    for what, value in checks.items():
        print(f"{what}: {value:.3g}")
    model_bytes = cpu["params"] * 4
    print(f"\nmodel: {cpu['params'] / 1e6:.1f}M parameters, {model_bytes / GIB:.2f} GiB fp32")
    print(
        "| built | build peak (GiB) | build (s) | peak over the steps (GiB) | save: peak over what training holds (GiB) | host max RSS (GiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")

    def gib(v: int | None) -> str:
        return "-" if v is None else f"{v / GIB:.2f}"

    for r in rows:
        print(
            f"| {r['how']} | {gib(r['build_peak'])} | {r['build_s']:.1f} | {gib(r['step_peak'])} "
            f"| {_over(r)} | {gib(r['host_maxrss'])} |"
        )
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {
        "benchmark": "gpu-meta-memory",
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "model_bytes": model_bytes,
        "knobs": knobs,
        "checks": checks,
        "rows": [{k: v for k, v in r.items() if k not in ("initial", "trained")} for r in rows],
    }
    slug = name.lower().replace(" ", "-")
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"gpu-meta-memory-{slug}{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
