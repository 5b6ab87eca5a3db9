"""Time to build the engine of a model on meta against constructing it on the CPU: one
process, a transformers Llama of 159M parameters (width 1024, 8 layers, vocabulary
32,000, tied embeddings), its own `_init_weights` replayed by meshfit (materialize.py).

    python benchmarks/meta_build_time.py              # 3 rounds, prints the medians
    python benchmarks/meta_build_time.py --rounds 1

The model is built from a config, nothing downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_fp8 import llama_config

import meshfit as mf

FIELDS = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def one_round() -> tuple[float, float]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    LlamaForCausalLM(llama_config(FIELDS))
    constructed = time.perf_counter() - start
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(FIELDS))
    start = time.perf_counter()
    mf.parallelize(model, None, loss_fn="model")
    return constructed, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = [one_round() for _ in range(args.rounds)]
    cpu = statistics.median(r[0] for r in rounds)
    meta = statistics.median(r[1] for r in rounds)
    print(f"threads {torch.get_num_threads()}; median of {args.rounds}")
    print(f"constructed on the CPU: {cpu:.2f} s; built on meta by parallelize: {meta:.2f} s")


if __name__ == "__main__":
    main()
