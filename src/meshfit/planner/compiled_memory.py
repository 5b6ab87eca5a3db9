"""What a compiled step keeps for backward, found by partitioning its graph on fake tensors.

`compile=True` hands forward and loss to torch.compile, whose AOT autograd splits the
joint forward-backward graph with a min-cut partitioner, after Inductor's decompositions:
a cross-entropy becomes max/exp/sum/log, which backward recomputes from the logits in the
compute dtype instead of keeping a float32 log-softmax; a GELU's output is recomputed from
its input. What the forward saves is then far less than eager autograd keeps (measured on
an H200: a 125M GPT's compiled peak was 42% under its eager one, BENCHMARKS.md), and the
eager count (profile.py) over-stated compiled peaks by 4-153%.

So the planner asks the same partitioner: it traces forward and loss with AOT autograd,
Inductor's decomposition table and the partitioner Inductor uses, on fake tensors (shapes
only: no memory, no kernel is generated), and reads the forward graph's saved outputs.
A tensor made from parameters alone (autocast's 2-byte weight copies) is left to the
estimate's own buffer rule; every other one is counted once per storage and attributed to
the part whose code made it (head, a block, tail: hooks name the part in each node's
metadata; the eager profile charges the part running when autograd saves a tensor, which
is the same but for the step's inputs, saved where they are used). Repeated blocks are
skipped as in the eager profile, so a 96-layer model traces one block of each kind.

The trace runs on fake CPU tensors under CPU autocast: torch cannot make fake CUDA tensors
without a CUDA build. CPU and CUDA autocast differ in a few ops (CUDA runs softmax,
log_softmax and layer_norm in float32, CPU in bf16), so a model that calls those itself
between matrix products may save more on a GPU than counted here; attention through
scaled_dot_product_attention and a cross-entropy loss are counted alike.

What is not traced: recomputation's forms (the estimate keeps block inputs, as eager),
pipeline stages (each block compiles alone; the block counts hold, the stage's prologue and
epilogue run eagerly), and a forward that cannot run on fake tensors (data-dependent
code): the estimate then uses the eager count and says so.
"""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import nn

from meshfit.planner.profile import (
    ModelProfile,
    _blocks_or_none,
    _call_functional,
    _NoBlocks,
    _repeats_skipped,
    _splits,
    _stand_ins,
)
from meshfit.trees import map_tensors, tensors_in

_PART = "meshfit_part"  # the key hooks put in a node's "custom" metadata


def count_compiled(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Any,
    example_targets: Any,
    profile: ModelProfile,
    precision: str,
) -> None:
    """Fill `profile`'s compiled counts (PartCost.compiled_saved, per sample) for a
    compiled step in `precision`, or note in profile.compiled_error why it cannot be
    traced (the estimate then counts the step as eager and says so)."""
    stack = _blocks_or_none(model)
    autocast = precision in ("bf16", "fp16", "fp8")
    samples = tensors_in(example_inputs)[0].shape[0]
    try:
        saved = compiled_saved(
            model, example_inputs, stack or _NoBlocks(), loss_fn, example_targets, autocast
        )
    except Exception as error:  # a trace that cannot run: the eager count stands
        profile.compiled_error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return
    keys = ["head", *(stack.keys if stack is not None else []), "tail"]
    for key, part in zip(keys, [profile.head, *profile.blocks, profile.tail], strict=True):
        size, split = saved.get(key, (0.0, 0.0))
        part.compiled_saved, part.compiled_saved_split = size / samples, split / samples
    profile.compiled_autocast = autocast


def compiled_saved(
    model: nn.Module,
    example_inputs: Any,
    stack: Any,
    loss_fn: Any,
    example_targets: Any,
    autocast: bool,
) -> dict[str, tuple[float, float]]:
    """{part: (bytes saved for backward, the part of them tensor parallel splits)} of one
    compiled training step on `example_inputs` (not per sample), parts named as the
    eager profile names them ("head", block keys, "tail"). autocast: bf16 autocast
    around forward and loss. Raises what the trace raised where it cannot run."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=False)
    with fake:
        # one name per tensor: functional_call ties the others back (a tied head traced
        # under both names would be two inputs it refuses)
        state = _once_each(_stand_ins(model, _fake_like))
        inputs = map_tensors(example_inputs, _fake_like)
        targets = map_tensors(example_targets, _fake_like)
    forwards: list[torch.fx.GraphModule] = []
    outputs_first: list[int] = []  # the forward's own outputs, before what it saves

    def keep(graph: torch.fx.GraphModule, _inputs: Any) -> torch.fx.GraphModule:
        forwards.append(graph)
        return graph

    def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        # the forward's outputs are its own (the loss, buffers it updates: BatchNorm's
        # running statistics), then the tensors saved for backward
        outputs_first.append(kwargs["num_fwd_outputs"])
        return min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="inductor", **kwargs
        )

    def step(state: dict[str, torch.Tensor], inputs: Any, targets: Any) -> torch.Tensor:
        _name_part("head")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outputs = _call_functional(model, state, inputs)
            return _loss(loss_fn, outputs, targets)

    traced = aot_function(
        step,
        fw_compiler=keep,
        bw_compiler=lambda graph, _inputs: graph,
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )
    widths: dict[str, int] = {}
    with (
        fx_traceback.preserve_node_meta(),  # outermost: the caller's metadata comes back
        # the user's code takes the branch it takes under torch.compile (Hugging Face's
        # mask code skips its data-dependent checks there)
        unittest.mock.patch.object(torch.compiler, "is_compiling", lambda: True),
        _parts_named(stack, widths),
        _repeats_skipped(stack) as repeats,
        fake,
    ):
        traced(state, inputs, targets)
    state_leaves = len(torch.utils._pytree.tree_leaves(state))
    saved = _saved_by_part(forwards[0], state_leaves, outputs_first[0], widths)
    for key, source in repeats.items():  # a repeated block saves what the first one does
        saved[key] = saved.get(source, (0.0, 0.0))
    return saved


def _once_each(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each tensor under its first name only."""
    seen: set[int] = set()
    kept = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            kept[name] = t
    return kept


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor of `t`'s shape, strides and dtype (`t` may be on meta)."""
    made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return made.requires_grad_(t.requires_grad) if t.is_floating_point() else made


def _loss(loss_fn: Any, outputs: Any, targets: Any) -> torch.Tensor:
    """The step's loss as the run computes it; with no loss given, a cross-entropy over
    the first floating output (the profile's assumption for logits)."""
    if callable(loss_fn) and targets is not None:
        return loss_fn(outputs, targets)
    floating = [t for t in tensors_in(outputs) if t.is_floating_point()]
    if loss_fn == "model":  # the model's own loss: a 0-dim output
        scalars = [t for t in floating if t.dim() == 0]
        return scalars[0] if scalars else floating[0].float().mean()
    logits = floating[0]
    if logits.dim() < 2:
        return logits.float().mean()
    flat = logits.reshape(-1, logits.shape[-1])
    labels = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return F.cross_entropy(flat, labels)


def _name_part(key: str) -> None:
    """Name `key` in the metadata of the nodes traced from here on, beside what else
    "custom" holds (annotations the partitioner reads)."""
    fx_traceback.current_meta["custom"] = {
        **fx_traceback.current_meta.get("custom", {}),
        _PART: key,
    }


@contextlib.contextmanager
def _parts_named(stack: Any, widths: dict[str, int]) -> Iterator[None]:
    """Hooks that name the running part in the metadata of the nodes traced under it,
    and note each block's input width (the tp split test of profile.py)."""
    keys = list(stack.keys)
    handles = []
    for i, (key, block) in enumerate(zip(keys, stack.blocks, strict=True)):
        after = keys[i + 1] if i + 1 < len(keys) else "tail"

        def before(module: nn.Module, args: tuple, kwargs: dict, _key: str = key) -> None:
            found = tensors_in((args, kwargs))
            if found:
                widths[_key] = found[0].shape[-1] if found[0].dim() else 1
            _name_part(_key)

        def done(module, args, kwargs, output, _after: str = after) -> None:
            _name_part(_after)

        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(done, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _saved_by_part(
    forward: torch.fx.GraphModule, state_leaves: int, own_outputs: int, widths: dict[str, int]
) -> dict[str, tuple[float, float]]:
    """Bytes of the forward graph's saved outputs (those after its `own_outputs`) made
    from the data (not from the model's state alone: its first `state_leaves` inputs),
    each storage once, by the part that made them."""
    nodes = list(forward.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    data = set(placeholders[state_leaves:])
    for node in nodes:  # program order: a node's inputs come before it
        if node.op != "placeholder" and any(a in data for a in node.all_input_nodes):
            data.add(node)
    output = next(n for n in nodes if n.op == "output")
    saved = output.args[0][own_outputs:]
    totals: dict[str, tuple[float, float]] = {}
    seen: set[int] = set()
    for node in saved:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or node not in data:
            continue
        storage = value.untyped_storage()._cdata
        if storage in seen:
            continue
        seen.add(storage)
        part = (node.meta.get("custom") or {}).get(_PART, "head")
        size = float(value.untyped_storage().nbytes())
        split = size if _splits(value, widths.get(part)) else 0.0
        kept, kept_split = totals.get(part, (0.0, 0.0))
        totals[part] = (kept + size, kept_split + split)
    return totals
