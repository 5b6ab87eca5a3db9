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
and the parameter names unchanged. The compiled function is bound to each block as a method
(a deep copy of the model rebinds it to the copy's blocks), one per forward function, so
blocks of one class share its graphs: one for training, one for evaluation.

A Hugging Face model hands each block its KV cache, in training too; torch then guards on
the cache's per-layer state and compiles a graph per layer, and after 8 (its recompile
limit) runs the rest eagerly (measured on a 20-layer Llama: 8 graphs, then eager). Under
pp the cache cannot cross stages anyway, so compiled blocks run without it
(`use_cache=False`), as recomputed ones do in training; this is said once.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from meshfit.parallel.recompute import rebind_forwards, without_cache

_COMPILED_CACHE = (
    "under pp with compile=True each {kind} compiles on its own, and a KV cache handed to "
    "it would make torch compile it once per layer; blocks run without the cache "
    "(use_cache=False): a pipeline stage cannot pass it to the next anyway"
)


def graphs_per_rank() -> None:
    """Keep compiled graphs with collectives from being shared between ranks.

    torch's AOT autograd cache (on disk, shared by every process of the machine) keys a
    graph without the process-group names baked into its collectives: under dp=2,tp=2
    ranks 2 and 3 loaded the graph ranks 0 and 1 had compiled, with their tp group
    ("Could not resolve the process group registered under the name 7"; measured on
    torch 2.13 with the LM head's all-gather, tests/test_compile.py). With that cache
    off each rank compiles its own graphs (inductor's own graph cache, whose key does
    include them, still serves later runs). Called for compile=True under tp."""
    import torch._functorch.config as functorch_config

    functorch_config.enable_autograd_cache = False


def compile_block_forwards(blocks: list[nn.Module]) -> None:
    """Replace each block's `forward` with a compiled one, in place (after tensor parallel
    and recomputation, which it then compiles too, and before data parallel wraps it)."""
    said: set[str] = set()
    fresh = [b for b in blocks if not getattr(b.forward, "_meshfit_compiled", False)]
    # a block listed twice, or compiled already, is compiled once
    rebind_forwards(list(dict.fromkeys(fresh)), lambda inner: _compiled(inner, said))


def _compiled(inner, said: set[str]):
    """`inner` (a function of the block and its inputs) through torch.compile, without
    a KV cache."""
    compiled = torch.compile(inner)

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        args, kwargs = without_cache(self, args, kwargs, said, _COMPILED_CACHE)
        return compiled(self, *args, **kwargs)

    forward._meshfit_compiled = True  # type: ignore[attr-defined]
    return forward
