"""The main job: train a small GPT on the Python standard library's source, byte by byte.

`meshfit demo` starts this module on the workers (2 CPU processes by default, every GPU
when there are some); `python -m meshfit.demo` runs it in one process. `meshfit demo
--verify` runs `verify_plans` instead: the promise, shown on a small demo GPT.
"""

from __future__ import annotations

import argparse
import ast
import functools
import math

import torch

import meshfit as mf
from meshfit.data import ByteTextDataset, python_stdlib_text
from meshfit.models import GPT, GPTConfig, next_token_loss

PROMPT = "def "


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshfit.demo", description=__doc__)
    add_demo_arguments(parser)
    return parser


def add_demo_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the demo's options to `parser`; returns them so `meshfit demo` can pass each
    one on to the workers without listing them a second time."""
    actions: list[argparse.Action] = []

    def option(*names: str, **kwargs) -> None:
        actions.append(parser.add_argument(*names, **kwargs))

    option("--steps", type=int, default=None, help="training steps (default 200; 3 with --verify)")
    option("--plan", default=None, help="e.g. 'dp=2' (default: dp over all workers)")
    option("--batch-size", type=int, default=32, help="GLOBAL batch in sequences (default 32)")
    option("--block-size", type=int, default=128, help="context length in bytes (default 128)")
    option("--layers", type=int, default=4)
    option("--width", type=int, default=128, help="embedding width (default 128)")
    option("--heads", type=int, default=4)
    option("--lr", type=float, default=2e-3)
    option("--data-bytes", type=int, default=4_000_000, help="bytes of stdlib source to use")
    option("--checkpoint-dir", default=None, help="save here and resume from here")
    option("--checkpoint-every", type=int, default=None)
    option("--sample-bytes", type=int, default=300, help="bytes to generate at the end")
    option("--seed", type=int, default=0)
    option(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other option of mf.parallelize, as a Python literal "
        "(e.g. --set compile=True --set pp_split=[2] --set grad_clip=0.5)",
    )
    return actions


# parallelize options the demo sets itself (from its own flags): not for --set
DEMO_SETS = ("loss_fn", "optimizer", "lr_scheduler", "example_inputs")


def parse_options(items: list[str]) -> dict[str, object]:
    """--set KEY=VALUE items -> keyword arguments for mf.parallelize (values are Python
    literals); a key parallelize does not take, or one the demo sets, is refused."""
    import inspect

    known = [
        name
        for name, p in inspect.signature(mf.parallelize).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in DEMO_SETS
    ]
    options = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise mf.MeshfitError(f"--set needs KEY=VALUE, e.g. --set compile=True; got {item!r}")
        if key.strip() not in known:
            raise mf.MeshfitError(
                f"--set {key.strip()}: not an option the demo passes on; use one of "
                f"{', '.join(known)} (the demo's own flags set the others)"
            )
        try:
            options[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise mf.MeshfitError(
                f"--set {key.strip()}: {raw!r} is not a Python literal (a number, True/False, "
                f"a string in quotes or a list)"
            ) from None
    return options


def warmup_cosine(total_steps: int, warmup: int):
    """LR multiplier: linear warm-up, then cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# With --verify: the options that still apply (the others size the training run).
VERIFY_OPTIONS = ("steps", "plan", "seed")


def verify_model(config: GPTConfig) -> GPT:
    """The model `verify_plans` trains: float64, where a correct plan is 1e-16-ish away
    from one process and a gradient off by one part in a million is not (a module-level
    function, so the workers can unpickle it)."""
    return GPT(config).double()


def verify_plans(
    nproc: int = 2,
    steps: int = 3,
    plan: str | None = None,
    seed: int = 0,
    devices: str | None = None,
    threads: int | None = None,
) -> tuple[str, list[mf.VerifyReport]]:
    """dp, fsdp, tp and pp on `nproc` processes each (or only `plan`), against one
    process, on a small demo GPT and real batches of the standard library's source; the
    plans share one launch. Returns the table's title and the reports."""
    from meshfit.verification.run import _Objects, sgd_momentum, verify_many

    if nproc < 2:
        raise mf.MeshfitError(f"--verify compares plans of 2 or more processes, not {nproc}")
    # Enough heads and blocks for tp=nproc and pp=nproc.
    heads = max(2, nproc)
    config = GPTConfig(
        vocab_size=256, block_size=32, n_layer=max(2, nproc), n_head=heads, n_embd=16 * heads
    )
    batch_size = 4 * nproc  # splits over dp=nproc and pp=nproc's 2*nproc micro-batches
    data = ByteTextDataset(
        python_stdlib_text(steps * batch_size * config.block_size + 1), config.block_size
    )
    batches = []
    for step in range(steps):
        samples = [data[step * batch_size + i] for i in range(batch_size)]
        batches.append(tuple(torch.stack(part) for part in zip(*samples, strict=True)))
    plans = [plan] if plan else [f"{form}={nproc}" for form in ("dp", "fsdp", "tp", "pp")]
    source = _Objects(
        functools.partial(verify_model, config), next_token_loss, {"optimizer": sgd_momentum}
    )
    reports = verify_many(
        source, plans, batches, nproc=nproc, seed=seed, devices=devices, threads=threads
    )
    params = sum(p.numel() for p in verify_model(config).parameters())
    title = (
        f"The demo GPT ({params:,} parameters, float64), {steps} steps of SGD (lr 0.1, "
        f"momentum 0.9) on batches of {batch_size} x {config.block_size} bytes of Python "
        f"source: each plan on {nproc} processes against one process"
    )
    return title, reports


def main(argv: list[str] | None = None) -> mf.fit.History:
    args = build_parser().parse_args(argv)
    if args.steps is None:
        args.steps = 200
    torch.manual_seed(args.seed)  # same initial weights on every rank
    config = GPTConfig(
        vocab_size=256,
        block_size=args.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    model = GPT(config)
    text = ByteTextDataset(python_stdlib_text(args.data_bytes), args.block_size)
    train, val = text.split(0.05)
    warmup = max(1, min(100, args.steps // 10))
    options = {"grad_clip": 1.0, **parse_options(args.set)}
    history = mf.fit(
        model,
        train,
        plan=args.plan,
        loss_fn=next_token_loss,
        optimizer=lambda params: torch.optim.AdamW(
            params, lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)
        ),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, warmup_cosine(args.steps, warmup)
        ),
        batch_size=args.batch_size,
        max_steps=args.steps,
        eval_dataset=val,
        eval_every=max(1, args.steps // 4),
        eval_batches=8,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        log_every=max(1, min(20, args.steps // 10)),
        seed=args.seed,
        **options,
    )
    engine = history.engine
    if args.sample_bytes <= 0:
        return history
    # Sample from the whole model: under fsdp/tp/pp no rank holds it, and a forward on
    # rank 0 alone would wait for the others' shards. Gathering it is collective.
    state = engine.full_state_dict()
    if engine.rank == 0:
        whole = GPT(config)
        whole.load_state_dict(state)
        whole.to(engine.device).eval()
        prompt = torch.tensor([list(PROMPT.encode())], device=engine.device)
        generator = torch.Generator(device=engine.device).manual_seed(args.seed)
        out = whole.generate(prompt, args.sample_bytes, generator=generator)
        sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")
        first, last = history.records[0]["loss"], history.records[-1]["loss"]
        print(
            f"\nloss {first:.3f} -> {last:.3f} over {len(history)} steps. A sample from the model:"
        )
        print("-" * 72)
        print(sample)
        print("-" * 72, flush=True)
    return history


if __name__ == "__main__":
    main()
