"""Targets for `meshfit plan` in BENCHMARKS.md (run from this directory):

cd benchmarks && meshfit plan planner_targets:gpt3 --hardware a100-80gb --nodes 128 --precision bf16
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
