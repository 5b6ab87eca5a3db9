"""Targets for `meshfit plan` in BENCHMARKS.md (run from this directory):

cd benchmarks && meshfit plan planner_targets:gpt3 --hardware a100-80gb --nodes 128 --precision bf16
cd benchmarks && meshfit plan planner_targets:qwen3_30b_a3b --hardware h100 --nodes 2
"""

from __future__ import annotations

import torch

from meshfit.models.gpt import GPT, GPTConfig, next_token_loss


def gpt3():
    """GPT-3 175B's shape on the meta device, a global batch of 1536 sequences."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288))  # fmt: skip
    tokens = torch.zeros(1536, 2048, dtype=torch.long)
    return model, (tokens, tokens), next_token_loss


def llama3_8b():
    """Llama-3-8B's shape (transformers' LlamaForCausalLM, bf16) on the meta device, a
    global batch of 8 sequences of 8,192 tokens with their labels (no attention mask:
    transformers checks a mask's values with .item(), which the meta device cannot
    answer; plan a longer context with --seq-len):

    cd benchmarks && meshfit plan planner_targets:llama3_8b --seq-len 131072 \\
        --hardware h100 --nodes 2 --precision bf16
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(8, 8192, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    return model, batch, "model"


def qwen3_30b_a3b():
    """Qwen3-30B-A3B's shape (transformers' Qwen3MoeForCausalLM: 48 layers, 128 experts
    of width 768, 8 per token; bf16) on the meta device, a global batch of 32 sequences of
    4,096 tokens with their labels:

    cd benchmarks && meshfit plan planner_targets:qwen3_30b_a3b --hardware h100 --nodes 2
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):  # bf16: torch._grouped_mm's meta kernel takes no other
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(32, 4096, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}, "model"
