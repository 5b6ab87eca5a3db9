"""Resident memory each rank gains over `mf.parallelize`: a transformers Llama built on
meta, its weights read with `weights=` from a save_pretrained directory, under fsdp=4 on
4 CPU workers, with glibc's default allocator settings (issue 48: "memory at build
depends on the allocator").

The figure per rank is its resident memory (VmRSS) at the end of parallelize and its
peak (VmHWM, reset just before the call) above its resident memory just before: what
the build needs the machine to have, not live tensors (benchmarks/meta_memory.py counts
those). Each rank's share of the model is a quarter of it.

    python benchmarks/build_resident.py                  # 582 MiB (100 MB files), 1,018 MiB (one file)
    python benchmarks/build_resident.py --models 582

Writes benchmarks/results/build-resident-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

import meshfit as mf

# name: (config, save_pretrained's max_shard_size)
MODELS = {
    "582": (  # tests/test_capped.py's Llama
        dict(vocab_size=1024, hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
             num_attention_heads=12, num_key_value_heads=12),
        "100MB",
    ),
    "1018": (
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=16),
        "5GB",
    ),
}  # fmt: skip


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def build(folder: str, config: dict) -> list[dict]:
    """On every worker: parallelize under fsdp=4; every rank's figures."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=False))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_mib("VmRSS:")
    mf.parallelize(model, "fsdp=4", loss_fn="model", weights=folder)
    mine = {"peak_mib": _status_mib("VmHWM:") - before, "after_mib": _status_mib("VmRSS:") - before}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="582,1018", help="comma list of " + ",".join(MODELS))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []
    for name in args.models.split(","):
        config, shard = MODELS[name]
        with tempfile.TemporaryDirectory() as folder:
            model = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=False))
            size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
            model.save_pretrained(folder, max_shard_size=shard)
            del model
            for run in range(args.runs):
                ranks = mf.launch(build, nproc=4, args=(folder, config))
                rows.append({"model_mib": size, "files": shard, "run": run, "ranks": ranks})
                peaks = ", ".join(f"{r['peak_mib']:,.0f}" for r in ranks)
                print(f"{size:,.0f} MiB model, run {run + 1}: peak per rank +{peaks} MiB "
                      f"(share {size / 4:,.0f})", flush=True)  # fmt: skip
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "build-resident-cpu.json"
    )
    with open(out, "w") as f:
        json.dump(
            {"benchmark": "build-resident", "date": time.strftime("%Y-%m-%d"), "rows": rows},
            f,
            indent=1,
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
