"""The share of block parameters that tensor parallel splits, per family, at real model
widths (two layers each: the share is per block, so depth does not change it). Run from
the repository root: PYTHONPATH=src:tests python tests/scripts/tp_share.py"""

from __future__ import annotations

import warnings

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from meshfit.parallel.tensor import derive_tp_plan, tp_share

CASES = {
    "gpt2 (124M widths)": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, vocab_size=256)),
    "llama (1B widths: 2048/5632, 32 heads, 4 kv heads)": lambda: LlamaForCausalLM(
        LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=256,
        )
    ),
    "bert-base widths": lambda: BertForMaskedLM(BertConfig(num_hidden_layers=2, vocab_size=256)),
    "gpt-neox (pythia-160m widths)": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_hidden_layers=2,
            vocab_size=256,
        )
    ),
    # Mixtral-8x7B's shape (8 experts, top 2, 4 query heads per key/value head, FFN 3.5 x
    # hidden) at a quarter of its width: the real one is 5.6 GB of fp32 experts per layer
    "mixtral (8 experts at 1/4 of 8x7B's widths: 1024/3584)": lambda: MixtralForCausalLM(
        MixtralConfig(
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=256,
        )
    ),
    "t5-small widths": lambda: T5ForConditionalGeneration(
        T5Config(vocab_size=256, num_layers=2, num_decoder_layers=2)
    ),
}

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    for name, make in CASES.items():
        torch.manual_seed(0)
        model = make()
        share = tp_share(model, derive_tp_plan(model))
        print(f"{name}: " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in share.items()))
