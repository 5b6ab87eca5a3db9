"""Tensor parallel: each block's matrix products split Megatron-LM's way.

The plan is derived from the computation, not from names: the model runs once on a tiny
input (Hugging Face's `dummy_inputs`, token ids or features for a first Embedding /
Linear, or the user's `example_inputs`) while every tensor computed inside a block is
labelled with where it came from: the block's input (the residual stream) and the
projections (nn.Linear, HF's Conv1D, plain convolutions: their channels are the
features) it was computed from. A projection that reads only
replicated values becomes column-parallel; one that reads only column-parallel outputs
(through per-element and per-head steps: activations, attention) row-parallel, its
all-reduce making the residual stream whole again: one all-reduce after attention and
one after the MLP, in forward and in backward. Column-parallel q/k/v give each rank whole
heads, so attention runs on the local heads with no communication. Outside the blocks,
an untied LM head is split over the vocabulary and its logits gathered (gathered_heads);
everything else (embeddings, norms, a head tied to the embedding) stays replicated on
every tp rank.

What the trace also settles: a fused projection whose output is first cut into N equal
parts (GPT-2's q|k|v) is split chunk by chunk, so each rank keeps whole heads of q, of k
and of v (GPT-NeoX views its fused output per head first: a plain column split does); an
Embedding inside a block that feeds split heads (T5's position bias) is split with them;
integer sizes the attention's forward reads (GPT-2's `split_size`, T5's `n_heads`) are
set to the local value when that reproduces tp rank 0's unsplit output on the traced
input. Experts kept as weight parameters of their own module (Mixtral's 3-D
gate_up_proj / down_proj) are followed through the views taken of them to the products
that multiply them, split per chunk / row-wise, and run on their local shards with one
all-reduce after all experts (_WeightShard); the router stays whole. The split model is
checked on that input before training: a split that changes it is refused, as is a
model with nothing to pair. A BatchNorm between a column-parallel convolution and its
row-parallel partner is split by channel with them (_ChannelShard: weights and running
statistics). For an `nn.Sequential` model, Linears (or convolutions) separated only by
element-wise layers (for convolutions, BatchNorm and pooling too) pair up.

Users can pass an explicit plan instead: ``{module name or pattern: "colwise" |
"colwise:N" (fused, N chunks) | "rowwise" | a torch ParallelStyle}``.

The package by job: trace.py (the labelled forward), derive.py (the plan from it),
split.py (styles and projection layers), check.py (sizes before, outputs and gradients
after), styles.py (the ParallelStyles torch lacks), apply.py (all of it in order),
form.py (the entry: a model with values, or one on meta),
report.py (what was split), state.py (checkpoint re-layout), meta.py (a model on meta:
derived and checked on a one-block CPU twin).
"""

from meshfit.parallel.tensor.apply import gathered_heads
from meshfit.parallel.tensor.check import check_tp_plan
from meshfit.parallel.tensor.derive import derive_tp_plan
from meshfit.parallel.tensor.form import apply_tensor_parallel
from meshfit.parallel.tensor.report import TPReport, split_numel, tp_share
from meshfit.parallel.tensor.split import HEAD_ATTRS, KV_HEAD_ATTRS, QKV_NAMES, TPPlan
from meshfit.parallel.tensor.state import copy_back_strided, strided_as_replicated

__all__ = [
    "HEAD_ATTRS",
    "KV_HEAD_ATTRS",
    "QKV_NAMES",
    "TPPlan",
    "TPReport",
    "apply_tensor_parallel",
    "check_tp_plan",
    "copy_back_strided",
    "derive_tp_plan",
    "gathered_heads",
    "split_numel",
    "strided_as_replicated",
    "tp_share",
]
