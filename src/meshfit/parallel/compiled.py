"""`compile=True` under every plan: where torch.compile goes.

Without pp the whole forward and the loss compile as one function (engine.py): the loss
(often a cross-entropy over a large vocabulary) fuses with the last layers, and that is
the form measured on an H100 (BENCHMARKS.md, 56.4% MFU against 42.5% eager). It works
under dp, fsdp and tp alike: FSDP2's hooks and DTensor's collectives run inside it, and
each plan reproduces the one-process run (tests/test_compile.py).

Under pp a stage runs the user's own forward over its part of the blocks, with hooks
that change per micro-batch (the activation received from the previous stage, the exit
after the stage's last block); compiling that forward would recompile for every new hook
and leave the cut. So each of this rank's blocks compiles its own `forward` instead, as
torchtitan compiles per block: the blocks are where the FLOPs are; the stage's prologue
and epilogue (embedding, final norm, head and loss) run eagerly. Compiling `forward`
rather than the module keeps hooks (FSDP2's, the pipeline's) outside the compiled code
and the parameter names unchanged; blocks of one type share one compiled graph.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def compile_block_forwards(blocks: list[nn.Module]) -> None:
    """Replace each block's `forward` with a compiled one, in place (after tensor parallel
    and recomputation, which it then compiles too, and before data parallel wraps it)."""
    for block in blocks:
        if getattr(block.forward, "_meshfit_compiled", False):
            continue  # a block shared by two stages' lists is compiled once
        compiled = torch.compile(block.forward)

        @functools.wraps(block.forward)
        def forward(*args, _compiled=compiled, **kwargs):
            return _compiled(*args, **kwargs)

        forward._meshfit_compiled = True  # type: ignore[attr-defined]
        block.forward = forward
