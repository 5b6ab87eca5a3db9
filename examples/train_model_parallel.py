"""Model parallel and hybrid plans: the demo GPT split by pipeline, tensor and sharded
data parallel.

    meshfit run --nproc 4 examples/train_model_parallel.py --plan pp=4
    meshfit run --nproc 4 examples/train_model_parallel.py --plan "pp=2,schedule=interleaved-1f1b"
    meshfit run --nproc 4 examples/train_model_parallel.py --plan tp=4
    meshfit run --nproc 8 examples/train_model_parallel.py --plan fsdp=2,tp=2,pp=2   # 3-D
    python examples/train_model_parallel.py --plan dp=1      # one process, the same numbers

The model's code does not change: meshfit finds its blocks (`model.blocks`), cuts them
into pipeline stages balanced by measured time, or splits each block's attention heads
and MLP over the tensor-parallel ranks. Checkpoints keep the model's own names, so a
run saved under one plan loads under another.
"""

import argparse

import torch

import meshfit as mf
from meshfit.data import ByteTextDataset, python_stdlib_text
from meshfit.models import GPT, GPTConfig, next_token_loss

parser = argparse.ArgumentParser()
parser.add_argument("--plan", default="pp=4", help="e.g. pp=4, tp=4, pp=2,schedule=gpipe")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch size")
args = parser.parse_args()

torch.manual_seed(0)  # every worker builds the same initial weights
config = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=128)
data = ByteTextDataset(python_stdlib_text(max_bytes=1_000_000), block_size=config.block_size)

history = mf.fit(
    GPT(config),
    data,
    plan=args.plan,  # pp: microbatches default to 2*pp; add ",microbatches=8" to change
    loss_fn=next_token_loss,
    optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3),
    batch_size=args.batch_size,
    max_steps=args.steps,
    grad_clip=1.0,
    log_every=10,
)
if history.engine.rank == 0:
    print(f"plan {history.engine.plan}: loss {history.losses[0]:.3f} -> {history.final_loss:.3f}")
