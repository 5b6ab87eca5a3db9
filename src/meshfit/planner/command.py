"""`meshfit plan TARGET`: the ranked plans for a model, before launching anything."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from meshfit.errors import MeshfitError
from meshfit.planner.auto import optimizer_for_planning
from meshfit.planner.hardware import Hardware, hardware, this_machine
from meshfit.planner.memory import _optimizer_bytes
from meshfit.planner.search import search_model
from meshfit.trees import tensors_in

PLAN_HELP = """\
Predict memory per rank and time per step for every plan of N devices and print them
ranked by throughput, with why the others were dropped. Nothing is launched: the model
runs one forward, on the meta device where it can (no memory, no time).

TARGET is module:function as for `meshfit verify` (returns (model, batch, loss_fn) or
(model, batch, loss_fn, options)); the batch's size is the global batch planned for
(--batch-size changes it). The model may be built on the meta device
(`with torch.device("meta"): model = ...`) to plan a model too big for this machine.

--seq-len N plans for sequences of N tokens: the batch's token tensors (those as long as
its input ids) are lengthened or cut to N, position ids counted 0..N-1 (on meta a forward
at 131,072 tokens costs nothing). Context parallel (cp) plans appear for token models.

Hardware: this machine's devices by default (--nproc workers), or a preset for a
machine you do not have: --hardware a100-40gb | a100-80gb | h100 | h200 with --nodes and
--gpus-per-node (8 by default).
"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None, help="devices to plan for (total)")
    parser.add_argument(
        "--hardware", default=None, help="a100-40gb, a100-80gb, h100, h200 (default: this machine)"
    )
    parser.add_argument("--nodes", type=int, default=None, help="nodes of --hardware")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="devices per node")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch to plan for")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence to plan for")
    parser.add_argument(
        "--precision",
        default=None,
        choices=("fp32", "bf16", "fp16", "fp8"),
        help="default: bf16 on GPUs (what people train in), fp32 on CPU workers; fp8 is "
        "planned at the bf16 rate",
    )
    parser.add_argument("--compile", action="store_true", help="plan for compile=True runs")
    parser.add_argument(
        "--chunked-loss",
        action="store_true",
        help="plan for chunked_loss=True runs (the target's options may say so too)",
    )
    parser.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    parser.add_argument("target", metavar="TARGET", help="module:function, see above")


def run_plan_command(args: argparse.Namespace) -> int:
    from meshfit.verification.run import _Target

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    model, batch, loss_fn, options = _Target(args.target).call(0)
    inputs, targets = _split(batch)
    if args.seq_len is not None:
        inputs, targets = at_sequence_length(inputs, targets, args.seq_len)
    found = tensors_in(inputs)
    if not found:
        raise MeshfitError(f"the batch {args.target}() returns holds no input tensor to plan on")
    batch_size = args.batch_size or found[0].shape[0]
    hw = _hardware(args)
    world = hw.world_size
    precision, why_precision = _precision(args, hw)
    optimizer = optimizer_for_planning(options.get("optimizer"), hw)
    state_bytes = _optimizer_bytes(optimizer)
    whose = "the target's optimizer" if options.get("optimizer") else "AdamW, the default"
    if options.get("optimizer") and isinstance(optimizer, str):  # how it steps counts too
        whose += f", {optimizer}"
    chunked = args.chunked_loss or options.get("chunked_loss", False)
    start = time.perf_counter()
    result = search_model(
        model,
        inputs,
        world,
        loss_fn=loss_fn,
        example_targets=targets,
        batch_size=batch_size,
        hardware=hw,
        optimizer=optimizer,
        precision=precision,
        compiled=args.compile,
        chunked_loss=chunked,
    )
    seconds = time.perf_counter() - start
    profile = result.profile
    assert profile is not None
    print(
        f"meshfit plan: {profile.name}, {profile.total_params / 1e6:,.1f}M parameters, "
        f"{len(profile.blocks)} {profile.block_kind} blocks, global batch {batch_size}, "
        f"{world} x {hw.name} ({hw.nodes} node(s) of {hw.devices_per_node}; {hw.source})"
    )
    tokens = f", {profile.tokens_per_sample:,} tokens per sequence"
    print(
        f"assuming: {precision} ({why_precision}), "
        f"{state_bytes:g} bytes of optimizer state per parameter ({whose})"
        f"{tokens if profile.tokens_per_sample > 1 else ''}, "
        f"{'compiled' if args.compile else 'eager (--compile plans compiled runs)'}, "
        f"{'the loss in chunks' if chunked else 'the logits whole (--chunked-loss: in chunks)'}"
    )
    if profile.tp_error:
        print(f"tensor parallel: {profile.tp_error}")
    if args.compile and profile.compiled_error:
        print(f"compiled memory counted as eager: the trace failed ({profile.compiled_error})")
    print(result.table(args.top))
    print(f"({len(result.ranked) + len(result.dropped)} plans in {seconds:.1f} s)")
    return 0 if result.ranked else 1


def at_sequence_length(inputs: Any, targets: Any, length: int) -> tuple[Any, Any]:
    """The batch with every token tensor (as long as the first integer tensor's second
    dimension: input ids, masks, labels, position ids) at `length` tokens: tiled or cut,
    position ids counted again; the other tensors as they are."""
    if length < 1:
        raise MeshfitError(f"--seq-len must be a positive number of tokens, not {length}")
    ids = [t for t in tensors_in(inputs) if t.dim() >= 2 and not t.is_floating_point()]
    if not ids:
        raise MeshfitError(
            "--seq-len needs a batch of token ids (an integer tensor of batch x tokens); "
            "this batch has none: give the sequence length in the batch itself"
        )
    old = ids[0].shape[1]

    def resize(path: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[1] != old:
            return t
        if "position" in path:
            counted = torch.arange(length, device=t.device, dtype=t.dtype)
            return counted.expand(t.shape[0], length).clone()
        reps = -(-length // old)
        return t.repeat(1, reps, *([1] * (t.dim() - 2)))[:, :length]

    return _map_named(inputs, resize), _map_named(targets, resize)


def _map_named(tree: Any, fn: Any, path: str = "") -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return {k: _map_named(v, fn, f"{path}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_named(v, fn, path) for v in tree)
    return tree


def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, list) and batch and isinstance(batch[0], tuple):
        batch = batch[0]  # a list of batches: plan on the first
    if isinstance(batch, tuple) and len(batch) == 2:
        return batch
    return batch, None


def _precision(args: argparse.Namespace, hw: Hardware) -> tuple[str, str]:
    """The precision planned for, and why: as given, else bf16 on GPUs (what people train
    in: fp32 ranked a Llama-3-8B shape on 16 H100s 15x slower than bf16) and fp32 on CPU
    workers."""
    if args.precision is not None:
        return args.precision, "--precision"
    if hw.name == "CPU":
        return "fp32", "the default on CPU workers; --precision bf16 to change"
    return "bf16", "the default on GPUs; --precision fp32 to change"


def _hardware(args: argparse.Namespace) -> Hardware:
    if args.hardware is None:
        if args.nodes is not None:
            raise MeshfitError(
                "--nodes is for --hardware (a preset); give --nproc for this machine"
            )
        nproc = args.nproc or 2
        return this_machine(nproc).with_nodes(1, nproc)
    per_node = args.gpus_per_node
    if args.nodes is None and args.nproc is None:
        raise MeshfitError("give --nodes (and --gpus-per-node) or --nproc with --hardware")
    if args.nodes is None:
        per_node = per_node or min(args.nproc, 8)
        if args.nproc % per_node:
            raise MeshfitError(f"--nproc {args.nproc} is not a whole number of nodes of {per_node}")
        return hardware(args.hardware, nodes=args.nproc // per_node, devices_per_node=per_node)
    hw = hardware(args.hardware, nodes=args.nodes, devices_per_node=per_node)
    if args.nproc is not None and args.nproc != hw.world_size:
        raise MeshfitError(
            f"--nproc {args.nproc} differs from --nodes {args.nodes} x {hw.devices_per_node} "
            f"devices per node; give one of them"
        )
    return hw
