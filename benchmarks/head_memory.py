"""Peak memory of one training step with the LM head and loss whole or in chunks
(`chunked_loss=True`), on the CPU: issue 50's "peak memory of a step for a 32k and a
128k vocabulary, before and after".

Model: a transformers LlamaForCausalLM built from a config (width 256, 2 layers, 4 heads
of which 2 key/value, MLP 512, untied head), vocabulary 32,000 or 128,256; its own loss
(`loss_fn="model"`, a collator's dict with labels), float32, AdamW, batch 4 x 512 tokens,
one process. Each row runs in a fresh process: three steps (the first builds the
optimizer's state and, compiled, the graphs); the row's figure is the process's peak
resident memory over them (Linux's VmHWM) above its resident memory once the model was
built: what the steps need the machine to have, not live tensors.

    python benchmarks/head_memory.py                       # 32k and 128k, eager and compiled
    python benchmarks/head_memory.py --vocab 32000 --modes eager

Writes benchmarks/results/head-memory-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BATCH, SEQ = 4, 512


def _status_mib(key: str) -> float:
    """A /proc/self/status figure (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def llama_config(vocab: int):
    """The model's config (planner_chunked.py plans and measures the same model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


def one_row(vocab: int, mode: str, chunked: bool) -> dict:
    """In this process: build, two steps, then the third step's peak."""
    import torch
    from transformers import LlamaForCausalLM

    import meshfit as mf

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab))
    built = _status_mib("VmRSS:")
    engine = mf.parallelize(model, loss_fn="model", compile=mode == "compile", chunked_loss=chunked)
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    for _ in range(2):
        engine.step(batch)
    start = time.perf_counter()
    loss = float(engine.step(batch))
    seconds = time.perf_counter() - start
    return {
        "vocab": vocab,
        "mode": mode,
        "loss_path": "chunked" if chunked else "whole",
        "model_mib": sum(p.numel() * 4 for p in model.parameters()) / 2**20,
        "peak_above_built_mib": _status_mib("VmHWM:") - built,
        "step_s": seconds,
        "loss": loss,
        "logits_fp32_mib": BATCH * SEQ * vocab * 4 / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="32000,128256", help="comma list")
    parser.add_argument("--modes", default="eager,compile", help="comma list of eager,compile")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row, in a child
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.row:
        vocab, mode, path = args.row.split(":")
        print(json.dumps(one_row(int(vocab), mode, path == "chunked")), flush=True)
        return
    rows = []
    for vocab in map(int, args.vocab.split(",")):
        for mode in args.modes.split(","):
            for path in ("whole", "chunked"):
                out = subprocess.run(
                    [sys.executable, __file__, "--row", f"{vocab}:{mode}:{path}"],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "2"},
                ).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"vocab {vocab:>7,} {mode:>7} {path:>7}: peak +{row['peak_above_built_mib']:,.0f} MiB "
                    f"(model {row['model_mib']:,.0f}, fp32 logits {row['logits_fp32_mib']:,.0f} MiB), "
                    f"third step {row['step_s']:.2f} s, "
                    f"loss {row['loss']:.6f}",
                    flush=True,
                )
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "head-memory-cpu.json"
    )
    with open(out, "w") as f:
        json.dump(
            {
                "benchmark": "head-memory",
                "date": time.strftime("%Y-%m-%d"),
                "batch": BATCH,
                "seq": SEQ,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
