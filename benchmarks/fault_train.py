"""The training run the fault campaign (faults.py) disturbs: a tiny GPT trained with
mf.fit and AdamW, checkpointing every few steps, under any plan. Rank 0 writes the final
weights' SHA-256 to --out, so an uninterrupted run and a disturbed one compare exactly.

    meshfit run --nproc 2 benchmarks/fault_train.py --plan pp=2 --checkpoint-dir /tmp/c --out r.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

import meshfit as mf
from meshfit.models import GPT, GPTConfig, next_token_loss

# Four blocks and four heads: room for tp=2, pp=2 and dp=2 x tp=2 x pp=2.
CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=4, n_embd=16, bias=False)


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.25, help="pause per step")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(CONFIG)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (256, CONFIG.block_size + 1), generator=g)
    history = mf.fit(
        model,
        (tokens[:, :-1], tokens[:, 1:]),
        loss_fn=next_token_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        plan=args.plan,
        batch_size=8,
        max_steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.every,
        keep_checkpoints=2,
        progress=False,
        log_every=args.steps,
        # The pause spreads a run over a few seconds, so a fault at a random moment
        # lands in steps and saves alike; it changes no number.
        callbacks=[lambda step, engine: time.sleep(args.step_seconds)],
    )
    state = history.engine.full_state_dict()  # every rank takes part
    if history.engine.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"digest": weights_digest(state), "losses": history.losses}, f)


if __name__ == "__main__":
    main()
