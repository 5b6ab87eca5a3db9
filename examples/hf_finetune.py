"""Fine-tune a Hugging Face causal LM with meshfit, the way the guide's first section
tells it: build the model on meta (no rank ever holds it whole), read pretrained weights
into each rank's part (`weights=`), train with the model's own loss on a data collator's
batches (input_ids, attention_mask, labels with -100 where no loss is taken), then save
a folder that `from_pretrained` reads.

    meshfit run --nproc 2 examples/hf_finetune.py --plan fsdp=2    # or tp=2, pp=2
    python examples/hf_finetune.py                                  # one process

Nothing is downloaded: without --weights the script first saves a small random Llama
as the "pretrained" folder (standing in for `snapshot_download`'s), and the text is
Python's own source code, tokenised by bytes. Change `CONFIG`, --weights and the data
to fine-tune a real model; nothing else changes between one process and a cluster.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshfit as mf

CONFIG = LlamaConfig(
    vocab_size=256,  # bytes
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LENGTH = 32


class SourceLines(torch.utils.data.Dataset):
    """Lines of the standard library's own source as byte ids, one sample per line."""

    def __init__(self, samples: int) -> None:
        text = open(os.__file__, encoding="utf-8").read()
        lines = [line.encode()[:LENGTH] for line in text.splitlines() if len(line) > 8]
        self.lines = lines[:samples]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(list(self.lines[i]))


def collate(lines: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collator's batch, as transformers' DataCollatorForLanguageModeling makes one:
    right-padded ids, their attention mask, labels -100 on the padding."""
    ids = torch.zeros(len(lines), LENGTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, line in enumerate(lines):
        ids[row, : len(line)], mask[row, : len(line)] = line, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def pretrained_stand_in(folder: str) -> str:
    """`folder`, or where it holds no checkpoint, a "pretrained" stand-in written there: a
    random Llama of CONFIG, saved as transformers saves one (safetensors shards and their
    index). One rank writes it, the others wait."""
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(folder, "config.json")):
            torch.manual_seed(0)
            LlamaForCausalLM(CONFIG).save_pretrained(folder, max_shard_size="100KB")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--weights", help="a save_pretrained folder (made as a stand-in where it is missing)"
    )
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "hf_finetuned"))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    weights = pretrained_stand_in(
        args.weights or os.path.join(tempfile.gettempdir(), "hf_finetune_pretrained")
    )

    with torch.device("meta"):  # every rank builds only the model's shape
        model = LlamaForCausalLM(CONFIG)
    history = mf.fit(
        model,
        SourceLines(samples=256),
        collate=collate,
        loss_fn="model",  # the model's own loss, from the batch's labels
        batch_size=8,
        max_steps=args.steps,
        weights=weights,  # each rank reads its part of the pretrained folder
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        progress=False,
    )
    folder = history.engine.save_model(args.out)  # on every rank: each gives its part
    if history.engine.rank == 0:
        reloaded = LlamaForCausalLM.from_pretrained(args.out)
        print(f"losses: {' '.join(f'{loss:.6f}' for loss in history.losses)}")
        print(f"saved {folder}; from_pretrained reads {reloaded.num_parameters():,} parameters")


if __name__ == "__main__":
    main()
