"""Tensor parallel: each block's matrix products split Megatron-LM's way.

The plan is derived from the computation, not from names: the model runs once on a tiny
input (Hugging Face's `dummy_inputs`, token ids or features for a first Embedding /
Linear, or the user's `example_inputs`) while every tensor computed inside a block is
labelled with where it came from: the block's input (the residual stream) and the
projections (nn.Linear, HF's Conv1D) it was computed from. A projection that reads only
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
model with nothing to pair (a CNN). For an `nn.Sequential` model, Linears separated
only by element-wise layers pair up.

Users can pass an explicit plan instead: ``{module name or pattern: "colwise" |
"colwise:N" (fused, N chunks) | "rowwise" | a torch ParallelStyle}``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import itertools
import re
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.overrides import TorchFunctionMode

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.recompute import rebind_forwards
from meshfit.trees import call_model, map_tensors, tensors_in

TPPlan = dict[str, "str | ParallelStyle"]

# q/k/v layers as the common families name them: only to find the head count on the
# model's config when a hand-written plan splits them (check_tp_plan).
QKV_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"}
HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
# Layers that act on each element (or each position) alone: a column-parallel output
# can pass through them to a row-parallel Linear unchanged.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
               nn.Mish, nn.Identity, nn.Dropout)  # fmt: skip
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def derive_tp_plan(model: nn.Module, example_inputs: Any = None) -> dict[str, str]:
    """{qualified projection name: "colwise" | "colwise:N" | "rowwise"} for `model`,
    found by running it once (see the module doc); "colwise:N" is a fused projection
    whose output is cut into N equal chunks (q|k|v) that are split one by one."""
    return _derive(model, example_inputs).plan


@dataclass
class _Derivation:
    plan: dict[str, str]
    inputs: Any = None  # what the model was traced on (None: a Sequential, not traced)
    # {attention-like module name: {int attribute its forward reads: global value}}
    local_attrs: dict[str, dict[str, int]] = field(default_factory=dict)
    # weight parameters in the plan (experts'), by qualified name: how they are multiplied
    weights: dict[str, _Weight] = field(default_factory=dict)
    # {module holding split weights: positions of its floating-point outputs to sum}
    owners: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # {module (named inside its block): why its weights stay whole}
    whole: dict[str, str] = field(default_factory=dict)
    # replicated parameters inside the blocks that act on column-parallel values (Qwen3's
    # per-head q_norm): each rank's gradient is its heads' part, summed over the tp ranks
    summed: list[str] = field(default_factory=list)


def _derive(model: nn.Module, example_inputs: Any = None) -> _Derivation:
    """The plan (a Sequential's pairs, else from one traced forward), with what the split
    model is checked against."""
    if type(model) is nn.Sequential:
        plan = _sequential_pairs(model, prefix="")
        if plan:
            return _Derivation(plan)
    try:
        stack = find_blocks(model)
    except MeshfitError:
        raise _nothing_to_split(model, "it has no stack of repeated blocks") from None
    plan: dict[str, str] = {}
    if all(type(b) is nn.Sequential for b in stack.blocks):
        for key, block in zip(stack.keys, stack.blocks, strict=True):
            plan.update(_sequential_pairs(block, prefix=f"{stack.qualified(key)}."))
        if set(plan.values()) == {"colwise", "rowwise"}:
            return _Derivation(plan)
    if not any(_is_projection(m) or _own_weights(m) for b in stack.blocks for m in b.modules()):
        kinds = sorted(
            {type(m).__name__ for b in stack.blocks for m in b.modules()} - {"Sequential"}
        )
        raise _nothing_to_split(
            model, f"its blocks hold no matrix-product layer (Linear), only {', '.join(kinds)}"
        )
    inputs = example_inputs if example_inputs is not None else _dummy_inputs(model)
    units = _block_units(model, stack)
    traces = _trace_blocks(model, units, inputs)
    modules = dict(model.named_modules())
    local_attrs: dict[str, dict[str, int]] = {}
    split = _Derivation(plan)
    for name, _ in units:
        trace = traces.get(name)
        if trace is None:
            continue
        whole: dict[str, str] = {}
        block_plan = _classify(trace, whole)
        plan.update(block_plan)
        split.summed += _partial_gradients(trace, block_plan)
        local_attrs.update(_stored_sizes(modules, block_plan))
        _note_weights(split, trace, block_plan, whole, prefix=f"{name}.")
    if "rowwise" not in plan.values():
        kept = "".join(f"; {owner} kept whole: {why}" for owner, why in split.whole.items())
        raise _nothing_to_split(
            model,
            f"no matrix product in its blocks ({stack.name or 'the model'!r}) reads the block's "
            f"input and feeds, through per-element or per-head steps only, one that writes back "
            f"to the block's output{kept}",
        )
    split.inputs, split.local_attrs = inputs, local_attrs
    return split


def _note_weights(
    split: _Derivation, trace: _BlockTrace, plan: dict[str, str], whole: dict[str, str], prefix: str
) -> None:
    """Record in `split` the weight parameters one block's plan splits, the outputs of
    the modules holding them that their all-reduce sums, and why others stay whole."""
    for name in plan:
        if name in trace.weights:
            split.weights[name] = trace.weights[name]
            owner = name.rsplit(".", 1)[0]
            rows = {n for n in plan if n.startswith(f"{owner}.") and plan[n] == "rowwise"}
            labels = trace.owner_outputs.get(owner, [])
            split.owners[owner] = tuple(i for i, label in enumerate(labels) if label & rows)
    for owner, why in whole.items():
        split.whole.setdefault(owner.removeprefix(prefix), why)


def _nothing_to_split(model: nn.Module, reason: str) -> MeshfitError:
    return MeshfitError(
        f"tensor parallel finds nothing to split in {type(model).__name__}: {reason}; use dp, "
        f"fsdp or pp (or pass parallelize(..., tp_plan={{'module.name': 'colwise', ...}}))"
    )


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 style Conv1D (weight (in, out), y = x @ W + b), by class name so
    transformers is not imported for models that do not use it."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def _dims(module: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a projection."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    rows, cols = module.weight.shape  # Conv1D: (in, out)
    return rows, cols


def _dummy_inputs(model: nn.Module) -> Any:
    """A tiny input to trace `model` on: Hugging Face's own `dummy_inputs`, else token ids
    for a model whose first layer is an Embedding, else features for a first Linear."""
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, Mapping) and dummy:
        device = next(model.parameters()).device
        return {k: v.to(device) for k, v in dummy.items()}
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    if first is None:
        raise _nothing_to_split(model, "meshfit cannot make an input to trace it with")
    g = torch.Generator().manual_seed(0)
    device = first.weight.device
    if isinstance(first, nn.Embedding):
        return torch.randint(0, first.num_embeddings, (2, 4), generator=g).to(device)
    x = torch.randn(2, first.in_features, generator=g, dtype=torch.float64)
    return x.to(device=device, dtype=first.weight.dtype)


@dataclass
class _Call:
    """One projection call inside a block: where its input came from, and the operation
    that first read its output."""

    name: str  # qualified module name (a weight parameter's name: see _Weight)
    sources: frozenset[str]  # "H" (the block's input) and earlier projections' names
    chunks: int = 1  # > 1: the output was first split into this many equal parts
    # labels of the integer operands (grouped_mm's offsets, from the router): they pick
    # rows, so they must be the same on every rank, but they are not what is multiplied
    side: frozenset[str] = frozenset()
    read: bool = False  # its output was read once already (chunks is settled)


@dataclass
class _Weight:
    """A weight parameter held by a module that is not a projection (a mixture of
    experts' 3-D `gate_up_proj` [experts, 2 x intermediate, hidden]), as a matrix product
    used it: which of its dimensions are the output and the input features."""

    out_dim: int
    in_dim: int


@dataclass
class _BlockTrace:
    calls: list[_Call] = field(default_factory=list)
    reaches_output: frozenset[str] = frozenset()
    # projections whose full output width was reduced over (a norm across all of q, as
    # OLMo2's q_norm): a rank holding a slice would normalise by its slice alone
    across_width: set[str] = field(default_factory=set)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    # weight parameters multiplied inside the block: {qualified name: how}
    weights: dict[str, _Weight] = field(default_factory=dict)
    # weight parameters read some other way too (their values, not only their shape):
    # left whole, {name: why}
    misused: dict[str, str] = field(default_factory=dict)
    # {module owning weight parameters: the labels of its floating-point outputs}
    owner_outputs: dict[str, list[frozenset[str]]] = field(default_factory=dict)
    # {parameter of the block: the labels of the values it was combined with}
    partners: dict[str, set[str]] = field(default_factory=dict)


class _Flow(TorchFunctionMode):
    """Labels every tensor computed inside a block with where it came from: the block's
    input ("H") and/or the projections whose outputs it was computed from (a projection's
    output starts a fresh label: its own name). Weights and side inputs (masks, position
    tables) carry no label.

    Weight parameters of other modules (a mixture of experts' 3-D `gate_up_proj`) are
    followed through the views a forward takes of them (one expert's slice, a transpose)
    to the matrix product that multiplies them (`linear`, `matmul`, `grouped_mm`): that
    product is a projection named after the parameter, called once however many experts
    ran. A weight read any other way is recorded as misused and left whole."""

    def __init__(self, trace: _BlockTrace) -> None:
        super().__init__()
        self.trace = trace
        self.labels: dict[int, frozenset[str]] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while tracing
        self.fresh: dict[int, _Call] = {}  # projection outputs not read yet
        self.widths: dict[str, set[int]] = {}  # each projection's output (and chunk) width
        self.across_width: set[str] = set()
        # {id of a weight parameter or a view of it: (parameter name, which parameter
        # dimension each of the view's dimensions is)}
        self.lineage: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.weight_calls: dict[str, _Call] = {}
        # {id of a block parameter, or of a value computed from parameters alone: their
        # names}: where such a value meets a labelled one, the labels are its partners
        self.params: dict[int, frozenset[str]] = {}

    def label(self, tree: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for t in tensors_in(tree):
            found |= self.labels.get(id(t), frozenset())
        return found

    def set(self, tree: Any, label: frozenset[str]) -> None:
        for t in tensors_in(tree):
            self.labels[id(t)] = label
            self.alive.append(t)

    def follow(self, name: str, weight: torch.Tensor) -> None:
        self.lineage[id(weight)] = (name, tuple(range(weight.ndim)))
        self.alive.append(weight)

    def watch(self, name: str, param: torch.Tensor) -> None:
        self.params[id(param)] = frozenset({name})
        self.alive.append(param)

    def _note_parameters(self, args: tuple, kwargs: dict, out: Any) -> None:
        """Record which labelled values each watched parameter (or a value computed from
        parameters alone, as Gemma's 1 + weight) is combined with."""
        names = frozenset().union(
            *(self.params[id(t)] for t in tensors_in((args, kwargs)) if id(t) in self.params)
        )
        if not names:
            return
        label = self.label((args, kwargs))
        if label:
            for name in names:
                self.trace.partners.setdefault(name, set()).update(label)
            return
        for t in tensors_in(out):
            self.params[id(t)] = names | self.params.get(id(t), frozenset())
            self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.params:
            self._note_parameters(args, kwargs, out)
        if self.lineage and self._weight_step(name, args, kwargs, out):
            return out
        reads = name != "__get__"  # not `.shape` and the like
        if reads and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.fresh:
            call = self.fresh.pop(id(args[0]))
            chunks = _equal_last_dim_parts(func, args[0], out)
            if call.read and chunks != call.chunks:  # one weight, its products cut two ways
                self.trace.misused.setdefault(call.name, "its products are cut two ways")
            call.chunks, call.read = chunks, True
            if call.chunks > 1:
                self.widths[call.name].add(args[0].shape[-1] // call.chunks)
        if args and isinstance(args[0], torch.Tensor) and _reduces_last_dim(func, args, kwargs):
            x = args[0]
            for label in self.labels.get(id(x), frozenset()):
                if x.shape[-1] > 1 and x.shape[-1] in self.widths.get(label, ()):
                    self.across_width.add(label)
        if name in _FRESH:  # a new buffer of the input's shape holds none of its values
            return out
        label = self.label((args, kwargs))
        if label:
            self.set(out, label | self.label(out) if _in_place(func) else label)
        return out

    def _weight_step(self, name: str, args: tuple, kwargs: dict, out: Any) -> bool:
        """Follow a step that takes a weight parameter (or a view of one): a view, a
        matrix product multiplying it (True: handled), or anything else (recorded as
        misused: left whole; False: labelled as usual)."""
        inside = [t for t in tensors_in((args, kwargs)) if id(t) in self.lineage]
        if not inside:
            return False
        if name in _METADATA and not isinstance(out, torch.Tensor):
            return False  # its shape, dtype or device only
        held = [i for i, a in enumerate(args) if id(a) in self.lineage]
        param, dims = self.lineage[id(inside[0])]
        if len(inside) > 1:  # two weights in one step (a concatenation): left whole
            for t in inside:
                self.trace.misused.setdefault(
                    self.lineage[id(t)][0], f"read by {name} with another weight"
                )
            return False
        if held == [0] and name in _WEIGHT_VIEWS:
            view = _view_dims(name, args, kwargs, dims)
            if view is not None and isinstance(out, torch.Tensor):
                self.lineage[id(out)] = (param, view)
                self.alive.append(out)
                return True
        if held == [1] and name in _MATMULS and isinstance(out, torch.Tensor):
            out_at, in_at = _MATMULS[name]
            if len(dims) >= 2:
                self._weight_call(param, _Weight(dims[out_at], dims[in_at]), args, kwargs, out)
                return True
        self.trace.misused.setdefault(param, f"read by {name}, which tp does not split")
        return False

    def _weight_call(
        self, param: str, how: _Weight, args: tuple, kwargs: dict, out: torch.Tensor
    ) -> None:
        """A matrix product of `param`: one call per weight, its inputs' labels merged."""
        others = tensors_in(([a for i, a in enumerate(args) if i != 1], kwargs))
        sources = self.label([t for t in others if t.is_floating_point()])
        side = self.label([t for t in others if not t.is_floating_point()])
        known = self.trace.weights.setdefault(param, how)
        if known != how:
            self.trace.misused.setdefault(param, "it is multiplied along two layouts")
        call = self.weight_calls.get(param)
        if call is None:
            call = self.weight_calls[param] = _Call(param, sources, side=side)
            self.trace.calls.append(call)
        else:
            call.sources, call.side = call.sources | sources, call.side | side
        self.set(out, frozenset({param}))
        self.widths.setdefault(param, set()).add(out.shape[-1])
        self.fresh[id(out)] = call


# Matrix products that may multiply a weight parameter (or a view of one) as their second
# operand, with the dimensions of that operand holding its (output, input) features:
# F.linear takes the weight as (..., out, in), the others as (..., in, out).
_MATMULS = {"linear": (-2, -1), "matmul": (-1, -2), "mm": (-1, -2), "bmm": (-1, -2),
            "__matmul__": (-1, -2), "_grouped_mm": (-1, -2), "grouped_mm": (-1, -2),
            "grouped_mm_fallback": (-1, -2)}  # fmt: skip
# Steps that give a view or a cast of a weight: one expert's slice, its transpose.
_WEIGHT_VIEWS = {"__getitem__", "transpose", "t", "permute", "to", "contiguous", "float",
                 "double", "half", "bfloat16", "type_as"}  # fmt: skip
# Steps that read a tensor's metadata only.
_METADATA = {"__get__", "size", "dim", "stride", "numel", "is_contiguous", "data_ptr",
             "element_size", "__len__", "is_floating_point", "get_device"}  # fmt: skip
# Steps whose output holds none of their input's values (a new buffer of its shape, as
# the zeros experts' outputs are added into).
_FRESH = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
          "new_empty", "new_full"}  # fmt: skip


def _view_dims(name: str, args: tuple, kwargs: dict, dims: tuple[int, ...]) -> tuple | None:
    """Which parameter dimension each dimension of a view of a weight is (None: a view
    this does not follow)."""
    if name in ("to", "contiguous", "float", "double", "half", "bfloat16", "type_as"):
        return dims
    n = len(dims)
    if name == "t":
        return dims[::-1] if n <= 2 else None
    if name == "transpose":
        a = kwargs.get("dim0", args[1] if len(args) > 1 else None)
        b = kwargs.get("dim1", args[2] if len(args) > 2 else None)
        if not isinstance(a, int) or not isinstance(b, int):
            return None
        swapped = list(dims)
        swapped[a % n], swapped[b % n] = dims[b % n], dims[a % n]
        return tuple(swapped)
    if name == "permute":
        order = args[1:]
        if len(order) == 1 and isinstance(order[0], (tuple, list)):
            order = tuple(order[0])
        if sorted(int(i) % n for i in order) != list(range(n)):
            return None
        return tuple(dims[int(i) % n] for i in order)
    if name == "__getitem__" and len(args) > 1:
        return _indexed_dims(args[1], dims)
    return None


def _indexed_dims(index: Any, dims: tuple[int, ...]) -> tuple | None:
    """The dimensions left after indexing leading dimensions (an expert by number, or
    gathering experts by a 1-D id tensor); None for any other index."""
    rest, kept, gathered = list(dims), [], 0
    for item in index if isinstance(index, tuple) else (index,):
        if not rest:
            return None
        if isinstance(item, slice) and item == slice(None):
            kept.append(rest.pop(0))
            continue
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() or item.dtype == torch.bool or item.ndim > 1:
                return None
            gathered += item.ndim
        elif not isinstance(item, int) or isinstance(item, bool):
            return None
        dim = rest.pop(0)
        if isinstance(item, torch.Tensor) and item.ndim == 1:
            kept.append(dim)
    return tuple(kept + rest) if gathered <= 1 else None


# Functions that combine the values along a tensor's last dimension.
_REDUCTIONS = {"mean", "sum", "var", "std", "norm", "vector_norm", "amax", "amin",
               "logsumexp", "softmax", "log_softmax", "var_mean", "std_mean"}  # fmt: skip
_NORMS = {"layer_norm", "rms_norm", "group_norm"}


def _reduces_last_dim(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name in _NORMS:
        return True
    if name not in _REDUCTIONS:
        return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None:
        return True  # over every dimension
    ndim = args[0].ndim
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(isinstance(d, int) and d % max(ndim, 1) == ndim - 1 for d in dims)


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _equal_last_dim_parts(func: Any, x: torch.Tensor, out: Any) -> int:
    """How many equal parts `func` cut `x`'s last dimension into (1: it did not): GPT-2's
    fused q|k|v is first `.split(embed_dim, dim=2)`; GPT-NeoX views per head first."""
    if getattr(func, "__name__", "") not in ("split", "chunk", "tensor_split", "split_with_sizes"):
        return 1
    if not isinstance(out, (tuple, list)) or len(out) < 2:
        return 1
    last = x.shape[-1]
    widths = {t.shape[-1] for t in out if isinstance(t, torch.Tensor) and t.ndim == x.ndim}
    if len(widths) == 1 and widths.pop() * len(out) == last:
        return len(out)
    return 1


@torch.no_grad()
def _block_units(model: nn.Module, stack: Any) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every block of the stack's type, in every container
    holding only such blocks: an encoder-decoder's two stacks (T5) both split."""
    kind = type(stack.blocks[0])
    units = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not len(container):
            continue
        if all(type(child) is kind for child in container.children()):
            units += [(f"{name}.{k}" if name else k, b) for k, b in container._modules.items()]
    return units or [(stack.qualified(k), b) for k, b in zip(stack.keys, stack.blocks, strict=True)]


def _trace_blocks(
    model: nn.Module, units: list[tuple[str, nn.Module]], inputs: Any
) -> dict[str, _BlockTrace]:
    """Run `model` once on `inputs` (eval mode), recording each block's first call."""
    names = {id(m): n for n, m in model.named_modules()}
    traces: dict[str, _BlockTrace] = {}
    handles = []
    current: list[tuple[str, _Flow, _BlockTrace]] = []

    def enter(key: str):
        def hook(block: nn.Module, args: tuple, kwargs: dict) -> None:
            if current or key in traces:
                return
            trace = _BlockTrace()
            flow = _Flow(trace)
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                return
            # the residual stream, and a decoder's view of the encoder output (passed by
            # name, or positionally with the same shape): replicated on every tp rank
            streams = [t for t in tensors_in(args) if t.shape == hidden.shape]
            streams += [v for k, v in kwargs.items() if "hidden_states" in k]
            for t in tensors_in(streams):
                if t.is_floating_point():
                    flow.set(t, frozenset({"H"}))
            for name, weight in _weights_of(block, key):
                flow.follow(name, weight)
            for name, param in block.named_parameters():
                flow.watch(f"{key}.{name}", param)
            traces[key] = trace
            current.append((key, flow, trace))
            flow.__enter__()

        return hook

    def leave(key: str):
        def hook(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not current or current[-1][0] != key:
                return
            _, flow, trace = current.pop()
            flow.__exit__(None, None, None)
            trace.across_width = flow.across_width
            first = tensors_in(output)[:1]  # the residual stream (not attention maps)
            trace.reaches_output = flow.label(first)

        return hook

    def before_projection(module: nn.Module, args: tuple) -> None:
        if not current:
            return
        _, flow, trace = current[-1]
        name = names[id(module)]
        trace.calls.append(_Call(name, flow.label(args)))
        trace.modules[name] = module

    def after_projection(module: nn.Module, args: tuple, output: Any) -> None:
        if not current:
            return
        _, flow, trace = current[-1]
        call = trace.calls[-1]
        flow.set(output, frozenset({call.name}))
        if isinstance(output, torch.Tensor):
            flow.widths[call.name] = {output.shape[-1]}
            flow.fresh[id(output)] = call

    def after_owner(module: nn.Module, args: tuple, output: Any) -> None:
        if current:
            _, flow, trace = current[-1]
            trace.modules[names[id(module)]] = module
            labels = [flow.label(t) for t in tensors_in(output) if t.is_floating_point()]
            trace.owner_outputs[names[id(module)]] = labels

    def after_table(module: nn.Module, args: tuple, output: Any) -> None:
        if current:
            _, flow, trace = current[-1]
            name = names[id(module)]
            trace.modules[name] = module
            flow.set(output, frozenset({TABLE + name}))

    for key, block in units:
        handles.append(block.register_forward_pre_hook(enter(key), with_kwargs=True))
        handles.append(block.register_forward_hook(leave(key), with_kwargs=True))
        for module in block.modules():
            if _is_projection(module):
                handles.append(module.register_forward_pre_hook(before_projection))
                handles.append(module.register_forward_hook(after_projection))
            elif isinstance(module, nn.Embedding):
                handles.append(module.register_forward_hook(after_table))
            elif _own_weights(module):
                handles.append(module.register_forward_hook(after_owner))
    training = model.training
    model.eval()
    try:
        call_model(model, inputs)
    except Exception as error:
        raise MeshfitError(
            f"tensor parallel traces {type(model).__name__} once to find what to split, and "
            f"its forward failed on {_describe_inputs(inputs)}: {type(error).__name__}: "
            f"{_first_line(error)}; pass example_inputs=... "
            f"(one micro-batch of inputs) or a tp_plan"
        ) from error
    finally:
        while current:
            current.pop()[1].__exit__(None, None, None)
        for handle in handles:
            handle.remove()
        model.train(training)
    return traces


def _own_weights(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The weight parameters (2-D or more) `module` itself holds, when it is not a
    projection or an Embedding: a mixture of experts' stacked expert weights, a router."""
    if _is_projection(module) or type(module).__module__.startswith("torch."):
        return []  # torch's own layers (Embedding, Conv2d, norms) are no experts
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.ndim >= 2]


def _weights_of(block: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) of every weight of `block` held outside projections."""
    return [
        (f"{prefix}.{owner}.{n}" if owner else f"{prefix}.{n}", p)
        for owner, module in block.named_modules()
        for n, p in _own_weights(module)
    ]


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def _describe_inputs(inputs: Any) -> str:
    if isinstance(inputs, Mapping):
        return "{" + ", ".join(f"{k}: {tuple(v.shape)}" for k, v in inputs.items()) + "}"
    return ", ".join(str(tuple(t.shape)) for t in tensors_in(inputs))


TABLE = "table:"  # the label of an Embedding's output inside a block


def _classify(trace: _BlockTrace, whole: dict[str, str] | None = None) -> dict[str, str]:
    """Megatron's pairs in one block's trace. A projection whose inputs are all replicated
    (the block input, a row-parallel output, an unsplit projection of those) is column-
    parallel; one whose inputs all come from column-parallel projections is row-parallel
    (its all-reduce makes its output replicated again). A column-parallel output that
    reaches anything else (the block output, an unsplit projection, a mix with the
    residual stream, a norm over its whole width) cannot be split: it is demoted and the
    trace classified again.
    An Embedding inside the block whose output mixes into a row-parallel input (T5's
    per-head position bias, (buckets, heads)) is split with the heads: column-parallel.
    Weight parameters of other modules (experts) pair only within the module holding
    them (see _owner_problems); why a module's weights stay whole goes into `whole`."""
    demoted: set[str] = set(trace.across_width) | set(trace.misused)
    whole = {} if whole is None else whole
    while True:
        state: dict[str, str] = {}
        bad: set[str] = set()
        for call in trace.calls:
            if call.name in state:  # called twice in one block: leave it whole
                bad.add(call.name)
                continue
            tables = {s for s in call.sources if s.startswith(TABLE)}
            srcs = call.sources - tables
            replicated = {s for s in srcs if s == "H" or state.get(s) in ("row", "whole")}
            sharded = {s for s in srcs if state.get(s) == "col"}
            # integer operands (which rows an expert takes) must be alike on every rank
            uneven = {s for s in call.side if state.get(s) == "col"}
            if uneven:
                state[call.name] = "whole"
                bad |= uneven
            elif (
                call.name not in demoted
                and srcs
                and replicated == srcs
                and "H" in _roots(call, trace)
            ):
                state[call.name] = "col"
            elif srcs and sharded == srcs:
                state[call.name] = "row"
                for table in tables:
                    state.setdefault(table.removeprefix(TABLE), "table")
            else:
                state[call.name] = "whole"
                bad |= sharded
        bad |= {s for s in trace.reaches_output if state.get(s) == "col"}
        read_by_row = {s for c in trace.calls if state.get(c.name) == "row" for s in c.sources}
        bad |= {n for n, s in state.items() if s == "col" and n not in read_by_row}
        bad |= _owner_problems(trace, state, whole)
        if not bad:
            break
        demoted |= bad
    for name, why in trace.misused.items():  # a module without a reason of its own above
        whole.setdefault(name.rsplit(".", 1)[0], f"{name.rsplit('.', 1)[-1]}: {why}")
    plan: dict[str, str] = {n: "colwise" for n, s in state.items() if s == "table"}
    for call in trace.calls:
        if state.get(call.name) == "col":
            plan[call.name] = f"colwise:{call.chunks}" if call.chunks > 1 else "colwise"
        elif state.get(call.name) == "row":
            plan[call.name] = "rowwise"
    return plan


def _partial_gradients(trace: _BlockTrace, plan: dict[str, str]) -> list[str]:
    """The parameters that `plan` leaves whole but that act on column-parallel values
    (per-head norms applied to each rank's own heads): each rank's gradient is the part
    of its heads, so the parts must be summed over the tp ranks (Megatron does the same
    for its q/k layer norms). The column-parallel values are the split projections'
    outputs and split position tables'."""
    sharded = {n for n, style in plan.items() if style.startswith("colwise")}
    sharded |= {TABLE + n for n in sharded}
    return [
        name
        for name, partners in trace.partners.items()
        if name not in plan and name.rsplit(".", 1)[0] not in plan and partners & sharded
    ]


def _owner_problems(trace: _BlockTrace, state: dict[str, str], whole: dict[str, str]) -> set[str]:
    """The column-parallel weights of modules whose weights cannot be split as a unit.
    Such a module (a mixture of experts) runs on its local shards with one all-reduce at
    its output, after every expert: that sums each rank's partial products only when
    its weights pair among themselves, it holds no other parameter (a bias would be
    added once per rank) and its input does not reach its output beside them."""
    by_owner: dict[str, list[str]] = {}
    for name in trace.weights:
        if state.get(name) in ("col", "row"):
            by_owner.setdefault(name.rsplit(".", 1)[0], []).append(name)
    bad: set[str] = set()
    for owner, names in by_owner.items():
        why = _owner_problem(trace, state, owner, names)
        if why:
            whole.setdefault(owner, why)
            bad |= {n for n in names if state[n] == "col"}
    return bad


def _owner_problem(trace: _BlockTrace, state: dict[str, str], owner: str, names: list[str]) -> str:
    """Why `owner`'s split weights `names` cannot be split as a unit ("" when they can)."""
    leaf = owner.rsplit(".", 1)[-1]
    module = trace.modules.get(owner)
    held = dict(module.named_parameters(recurse=False)) if module is not None else {}
    others = sorted(n for n in held if f"{owner}.{n}" not in names)
    if others:
        return f"{leaf} also holds {', '.join(others)}, which would stay whole"
    rows = {n for n in names if state[n] == "row"}
    for call in trace.calls:
        outside = call.name not in names
        if outside and any(s in names and state[s] == "col" for s in call.sources):
            return f"{leaf}'s column-parallel products are read outside it ({call.name})"
        if not outside and state[call.name] == "row":
            if any(state.get(s) == "col" and s not in names for s in call.sources):
                return f"{leaf}'s row-parallel products read products outside it"
    outputs = trace.owner_outputs.get(owner, [])
    if not any(label & rows for label in outputs):
        return f"{leaf}'s output holds none of its row-parallel products"
    if any(label & rows and "H" in label for label in outputs):
        return f"{leaf} adds its input to its products, which tp would sum once per rank"
    return ""


def _roots(call: _Call, trace: _BlockTrace) -> set[str]:
    """The block-input roots behind `call` (through row-parallel and whole projections)."""
    by_name = {c.name: c for c in trace.calls}
    seen, todo, roots = set(), list(call.sources), set()
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        if s == "H":
            roots.add(s)
        elif s in by_name:
            todo.extend(by_name[s].sources)
    return roots


def _stored_sizes(modules: dict[str, nn.Module], plan: dict[str, str]) -> dict[str, dict[str, int]]:
    """{module holding a column/row pair: {int attribute its forward reads: value}} for
    the attributes that hold a head count or a split width, which each tp rank must see
    as its local value (GPT-2's `split_size`, T5's `n_heads`): candidates, which
    `_settle_local_sizes` tries on the split model."""
    widths = set()
    for name, style in plan.items():
        if name in modules and style.startswith("colwise") and _is_projection(modules[name]):
            chunks = int(style.split(":")[1]) if ":" in style else 1
            widths.add(_dims(modules[name])[1] // chunks)
    owners = {name.rsplit(".", 1)[0] for name in plan if "." in name}
    found: dict[str, dict[str, int]] = {}
    for owner in owners:
        module = modules.get(owner)
        if module is None:
            continue
        read = _attributes_read(type(module))
        attrs = {}
        for attr in read:
            value = getattr(module, attr, None)
            if type(value) is not int or attr.endswith(("head_dim", "head_size")):
                continue
            if attr in HEAD_ATTRS or attr in KV_HEAD_ATTRS or value in widths:
                attrs[attr] = value
        if attrs:
            found[owner] = attrs
    return found


def _attributes_read(cls: type) -> set[str]:
    """`self.<name>` reads in `cls.forward`'s source (empty when it has none to read)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"\bself\.([A-Za-z_]\w*)\b(?!\s*\()", source))


def _sequential_pairs(seq: nn.Sequential, prefix: str) -> dict[str, str]:
    """Pair Linears in a Sequential that only element-wise layers separate."""
    plan: dict[str, str] = {}
    pending: str | None = None  # a Linear waiting for its row-parallel partner
    for key, child in seq._modules.items():
        if isinstance(child, nn.Linear):
            if pending is None:
                pending = key
            else:
                plan[prefix + pending] = "colwise"
                plan[prefix + key] = "rowwise"
                pending = None
        elif not isinstance(child, ELEMENTWISE):
            pending = None
    return plan


def check_tp_plan(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Refuse up front a plan that tp does not divide: sharded Linear dimensions, and
    the head count of any attention module whose projections are split. Pattern keys
    ("blocks.*.mlp.fc1", as torch's parallelize_module takes them) are checked for every
    module they match."""
    modules = dict(model.named_modules())
    plan = {
        name: _style_name(style) for key, style in plan.items() for name in _matching(modules, key)
    }
    for name, style in plan.items():
        module = modules.get(name)
        if isinstance(module, nn.Embedding) and style == "colwise":
            if module.embedding_dim % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide {name}'s {module.embedding_dim} columns (a "
                    f"per-head table, split with the heads); use a tp that divides them"
                )
            continue
        if module is None or not _is_projection(module) or style is None:
            continue
        fan_in, fan_out = _dims(module)
        chunks = int(style.split(":")[1]) if ":" in style else 1
        size, what = (fan_out, "output") if style.startswith("colwise") else (fan_in, "input")
        if size % (tp * chunks):
            each = f" in each of its {chunks} fused parts" if chunks > 1 else ""
            raise MeshfitError(
                f"tp={tp} does not divide {name}'s {what} size {size // chunks}{each} "
                f"({style.split(':')[0]}-parallel splits it); use a tp that divides "
                f"{size // chunks}"
            )
    config = getattr(model, "config", None)
    attention = {}  # in plan order, so the first offender is named
    for n, s in plan.items():
        if s is None or not s.startswith("colwise") or "." not in n:
            continue
        owner, leaf = n.rsplit(".", 1)
        # a q/k/v name may keep its head count on the config; any other owner counts
        # only with a head count of its own (an MLP has none)
        attention.setdefault(owner, leaf in QKV_NAMES)
    for name, use_config in attention.items():
        owner = modules.get(name)
        if owner is None:
            continue
        for attrs in (HEAD_ATTRS, KV_HEAD_ATTRS):
            heads = _first_attr(owner, attrs)
            if heads is None and use_config:
                heads = _first_attr(config, attrs)
            if isinstance(heads, int) and heads % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide the {heads} attention heads of {name} (each "
                    f"rank must hold whole heads); use a tp that divides {heads}"
                )


def _matching(modules: dict[str, nn.Module], key: str) -> list[str]:
    """Module names `key` names: itself, or every match of a pattern whose dot-separated
    parts are matched one by one (fnmatch), as parallelize_module matches them."""
    if key in modules or "*" not in key and "?" not in key and "[" not in key:
        return [key]
    parts = key.split(".")
    return [
        name
        for name in modules
        if len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, p) for a, p in zip(name.split("."), parts, strict=True))
    ]


def _style_name(style: object) -> str | None:
    """ "colwise" / "rowwise" for a style given as text or as torch's ParallelStyle."""
    if isinstance(style, str):
        return style
    if isinstance(style, _LocalShard):
        return style.style
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def _first_attr(obj: object, names: tuple[str, ...]) -> object:
    for attr in names:
        value = getattr(obj, attr, None)
        if value is not None:
            return value
    return None


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    tp_plan: TPPlan | None = None,
    example_inputs: Any = None,
) -> nn.Module:
    """Shard `model`'s projections over `mesh` (a 1-D tp mesh) and make the replicated
    parameters identical on every tp rank. A derived plan is checked on the traced
    input: the split model must give tp rank 0's one-process output, or it is refused."""
    tp = mesh.size()
    derivation = None
    if tp_plan is None:
        derivation = _derive(model, example_inputs)
        plan: dict[str, Any] = dict(derivation.plan)
        check_tp_plan(model, {n: v for n, v in plan.items() if n not in derivation.weights}, tp)
        _check_weight_sizes(model, derivation, tp)
        _check_local_sizes(derivation, tp)
    else:
        plan = {name: style for name, style in tp_plan.items()}
        check_tp_plan(model, {n: s for n, s in plan.items() if isinstance(s, str)}, tp)
    modules = dict(model.named_modules())
    styles: dict[str, ParallelStyle] = {}
    heads: dict[str, int] = {}
    if derivation is not None:
        styles.update(_weight_styles(derivation))
        inputs = derivation.inputs if derivation.inputs is not None else example_inputs
        if inputs is not None and type(model) is not nn.Sequential:  # one with blocks
            heads, kept = gathered_heads(model, inputs, tp)
            derivation.whole.update(kept)
            styles.update({name: ColwiseParallel(output_layouts=Replicate()) for name in heads})
    for name, style in plan.items():
        if derivation is not None and name in derivation.weights:
            continue  # split with the module holding it (_weight_styles)
        if isinstance(style, ParallelStyle):
            styles[name] = style
        elif isinstance(style, str) and style.split(":")[0] in STYLES:
            kind, _, chunks = style.partition(":")
            module = modules.get(name)
            if isinstance(module, (nn.Linear, nn.Embedding)) and not chunks:
                styles[name] = STYLES[kind]()
            else:  # Conv1D, or a fused projection split chunk by chunk
                styles[name] = _LocalShard(kind, int(chunks or 1))
        else:
            raise MeshfitError(
                f"tp_plan[{name!r}] = {style!r}: use 'colwise', 'rowwise' or a "
                f"torch.distributed.tensor.parallel ParallelStyle"
            )
    reference, scale, gradients = None, True, {}
    if derivation is not None and derivation.inputs is not None:
        reference = _outputs(model, derivation.inputs, _column_weights(model, derivation.plan))
        if not all(bool(t.isfinite().all()) for t in reference):  # fp16 overflow: unscaled
            scale = False
            reference = _outputs(model, derivation.inputs)
        gradients = _gradients(model, derivation.inputs, _checked_gradients(model, derivation))
    # DTensor shards each weight from tp rank 0's copy (src_data_rank=0).
    parallelize_module(model, mesh, styles)
    _broadcast_replicated(model, mesh)
    _share_random_state(mesh)
    if derivation is not None:
        _sum_gradients_over_tp(model, mesh, derivation.summed)
        if reference is not None:
            # the split model's own parameters (sharding replaced the objects)
            scaled = _column_weights(model, derivation.plan) if scale else []
            _settle_local_sizes(model, mesh, derivation, reference, scaled)
            _check_gradients(model, mesh, derivation, gradients)
        _SHARES[model] = tp_share(model, derivation.plan)
        _WHOLE[model] = dict(derivation.whole)
        _HEADS[model] = heads
    return model


def gathered_heads(
    model: nn.Module, inputs: Any, tp: int | None = None
) -> tuple[dict[str, int], dict[str, str]]:
    """({LM head tp splits over its outputs: its output count}, {one it keeps whole: why}).

    Megatron-LM's column-parallel LM head with its output gathered. A head here is an
    nn.Linear outside the blocks, run after them on `inputs`, that widens what they made
    (out_features > in_features: a vocabulary); it is the largest layer left outside the
    blocks (Llama 3 8B: 0.5B of 8B parameters, 6% of the FLOPs). Each tp rank keeps 1/tp
    of its weights, gradients and optimizer state and computes 1/tp of its outputs; one
    all-gather makes the output whole (the logits, as before), and the gradient of its
    input is all-reduced in backward. Kept whole: a weight shared with another layer (a
    head tied to the token embedding: splitting one would untie them), and a head whose
    outputs `tp` does not divide (GPT-2's 50257). The token embedding stays whole:
    torch's row-parallel embedding has no sharded backward (its gradient is made
    full-size on every rank, then reduced).
    """
    units = _block_units(model, find_blocks(model))
    inside = tuple(f"{name}." for name, _ in units)
    wide = {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and not name.startswith(inside)
        and module.out_features > module.in_features
    }
    if not wide:
        return {}, {}
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rsplit(".", 1)[0])
    heads: dict[str, int] = {}
    kept: dict[str, str] = {}
    for name in _run_after_blocks(model, units, wide, inputs):
        module = wide[name]
        others = [o for o in owners.get(id(module.weight), []) if o != name]
        if others:
            kept[name] = f"its weight is tied to {others[0]}'s"
        elif tp is not None and module.out_features % tp:
            kept[name] = f"tp={tp} does not divide its {module.out_features} outputs"
        else:
            heads[name] = module.out_features
    return heads, kept


@torch.no_grad()
def _run_after_blocks(
    model: nn.Module, units: list[tuple[str, nn.Module]], layers: dict[str, nn.Module], inputs: Any
) -> list[str]:
    """Those of `layers` whose first call on `inputs` (eval mode) comes after the last
    block's: the head, not an input projection."""
    calls: list[str] = []
    first: dict[str, int] = {}
    handles = [b.register_forward_hook(lambda *_: calls.append("")) for _, b in units]
    for name, layer in layers.items():

        def seen(*_: Any, name: str = name) -> None:
            first.setdefault(name, len(calls))
            calls.append(name)

        handles.append(layer.register_forward_hook(seen))
    training = model.training
    model.eval()
    try:
        call_model(model, inputs)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    last_block = max((i for i, c in enumerate(calls) if c == ""), default=-1)
    return [name for name in layers if first.get(name, -1) > last_block]


def _weight_styles(derivation: _Derivation) -> dict[str, ParallelStyle]:
    """{module holding split weight parameters: its _WeightShard}."""
    by_owner: dict[str, dict[str, tuple[str, int, int]]] = {}
    for name, how in derivation.weights.items():
        owner, leaf = name.rsplit(".", 1)
        kind, _, chunks = derivation.plan[name].partition(":")
        dim = how.out_dim if kind == "colwise" else how.in_dim
        by_owner.setdefault(owner, {})[leaf] = (kind, dim, int(chunks or 1))
    return {
        owner: _WeightShard(weights, derivation.owners.get(owner, ()))
        for owner, weights in by_owner.items()
    }


def _check_weight_sizes(model: nn.Module, derivation: _Derivation, tp: int) -> None:
    params = dict(model.named_parameters())
    for name, how in derivation.weights.items():
        kind, _, chunks = derivation.plan[name].partition(":")
        parts = int(chunks or 1)
        dim = how.out_dim if kind == "colwise" else how.in_dim
        size = params[name].shape[dim] // parts
        if size % tp:
            each = f" in each of its {parts} fused parts" if parts > 1 else ""
            raise MeshfitError(
                f"tp={tp} does not divide {name}'s dimension {dim} of size {size}{each} "
                f"({kind.removesuffix('wise')}-parallel splits it); use a tp that divides {size}"
            )


def _check_local_sizes(derivation: _Derivation, tp: int) -> None:
    for owner, attrs in derivation.local_attrs.items():
        for attr, value in attrs.items():
            if value % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide {owner}.{attr} = {value}, which its forward "
                    f"reshapes with (each rank keeps {attr} / tp); use a tp that divides {value}"
                )


# What the column-parallel weights are multiplied by while the split is checked: at
# initialisation q.k scores are near zero, attention is near uniform, and a wrong
# grouping of heads then moves the output by 1e-7 only (measured: meshfit's GPT with its
# head count wrongly localised passed a 1e-3 check and trained 4e-7 off). Sharper scores
# make any wrong grouping show; a power of two scales and unscales exactly.
CHECK_SCALE = 16.0


def _column_weights(model: nn.Module, plan: dict[str, str]) -> list[nn.Parameter]:
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    return [
        modules[name].weight if name in modules else params[name]
        for name, style in plan.items()
        if style.startswith("colwise")
        and (name in modules and _is_projection(modules[name]) or name in params)
    ]


@torch.no_grad()
def _outputs(
    model: nn.Module, inputs: Any, scaled: list[nn.Parameter] | None = None
) -> list[torch.Tensor]:
    """The model's floating-point outputs on `inputs` in eval mode, with the `scaled`
    weights multiplied by CHECK_SCALE meanwhile (a sharded one on its local shard)."""
    training = model.training
    model.eval()
    locals_ = [w.to_local() if isinstance(w, DTensor) else w.data for w in scaled or []]
    for w in locals_:
        w.mul_(CHECK_SCALE)
    try:
        out = call_model(model, inputs)
    finally:
        for w in locals_:
            w.div_(CHECK_SCALE)
        model.train(training)
    found = []
    for t in tensors_in(out):
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if t.is_floating_point():
            found.append(t.detach().clone())
    return found


def _settle_local_sizes(
    model: nn.Module,
    mesh: DeviceMesh,
    derivation: _Derivation,
    reference: list[torch.Tensor],
    scaled: list[nn.Parameter],
) -> None:
    """Which stored sizes each rank must see as its local value, tried on the traced input:
    GPT-2 splits its fused output with `split_size` (local: the q width per rank), while
    meshfit's GPT divides the full width by `n_head` (global). Each choice of the
    candidate attribute names, most localised first, is run; the first whose output
    matches tp rank 0's unsplit model is kept. None matching (a reshape the split cannot
    reach, a fused layout read another way) is refused on every tp rank alike."""
    modules = dict(model.named_modules())
    names = sorted({attr for attrs in derivation.local_attrs.values() for attr in attrs})
    # every subset when there are few candidates (one forward each on a tiny input);
    # with many, all of them or none
    sizes = range(len(names), -1, -1) if len(names) <= 4 else (len(names), 0)
    choices = [set(chosen) for k in sizes for chosen in itertools.combinations(names, k)]
    tp = mesh.size()
    problem = ""
    for chosen in choices:
        for owner, attrs in derivation.local_attrs.items():
            for attr, value in attrs.items():
                setattr(modules[owner], attr, value // tp if attr in chosen else value)
        problem = _compare(model, mesh, derivation.inputs, reference, scaled)
        if not problem:
            return
    raise MeshfitError(
        f"tensor parallel split {type(model).__name__} as derived "
        f"({_plan_summary(derivation.plan)}) and {problem}; pass a tp_plan, or use dp, "
        f"fsdp or pp"
    )


def _compare(
    model: nn.Module,
    mesh: DeviceMesh,
    inputs: Any,
    reference: list[torch.Tensor],
    scaled: list[nn.Parameter],
) -> str:
    """ "" when the split model reproduces tp rank 0's `reference` outputs on `inputs`,
    else what differs (the same answer on every tp rank)."""
    problem = ""
    try:
        got = _outputs(model, inputs, scaled)
    except Exception as error:  # the same code on every rank: all fail alike
        problem = f"its forward failed: {type(error).__name__}: {_first_line(error)}"
    else:
        if mesh.get_local_rank() == 0:
            if len(got) != len(reference):
                problem = f"it returned {len(got)} float tensors instead of {len(reference)}"
            for a, b in zip(got, reference, strict=False):
                if problem:
                    break
                if a.shape != b.shape:
                    problem = f"an output's shape changed from {tuple(b.shape)} to {tuple(a.shape)}"
                    break
                scale = b.abs().max().item() + 1e-12
                # a wrong split moves outputs by their own size (with CHECK_SCALE);
                # rounding (the all-reduce sums in another order) by far less
                rtol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(b.dtype, 3e-2)
                if (a - b).abs().max().item() > rtol * scale:
                    problem = (
                        f"its output moved by {(a - b).abs().max().item():.3g} "
                        f"(of {scale:.3g}) on the traced input"
                    )
                    break
    box = [problem]
    group = mesh.get_group()
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _checked_gradients(model: nn.Module, derivation: _Derivation) -> list[str]:
    """The parameters whose gradients the backward check compares: every one inside the
    blocks that the plan leaves whole (small: norms, biases, routers), where a gradient
    that is only this rank's part would go unnoticed by the forward check, and all of the
    first block's, split ones included (one block's worth of memory)."""
    units = _block_units(model, find_blocks(model))
    split = set(derivation.plan)
    names = []
    for i, (unit, block) in enumerate(units):
        for name, _ in block.named_parameters():
            full = f"{unit}.{name}"
            if i == 0 or (full not in split and full.rsplit(".", 1)[0] not in split):
                names.append(full)
    return names


def _gradients(model: nn.Module, inputs: Any, names: list[str]) -> dict[str, torch.Tensor | None]:
    """{name: gradient (whole)} of the named parameters for one backward on `inputs` (eval
    mode) of a fixed random projection of the model's floating-point outputs, the same
    on every rank. Parameters' .grad are left as they were."""
    params = dict(model.named_parameters())
    chosen = [n for n in names if params[n].requires_grad]
    if not chosen:
        return {}
    training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            outputs = [
                t.full_tensor() if isinstance(t, DTensor) else t
                for t in tensors_in(call_model(model, inputs))
                if t.is_floating_point() and t.requires_grad
            ]
            if not outputs:
                return {}
            g = torch.Generator().manual_seed(0)
            total = sum(
                (t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t)).sum()
                for t in outputs
            )
            grads = torch.autograd.grad(total, [params[n] for n in chosen], allow_unused=True)
    finally:
        model.train(training)
    return {
        n: None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).detach()
        for n, g in zip(chosen, grads, strict=True)
    }


def _check_gradients(
    model: nn.Module,
    mesh: DeviceMesh,
    derivation: _Derivation,
    reference: dict[str, torch.Tensor | None],
) -> None:
    """The backward check beside the forward one: on the traced input, the split model's
    gradients (whole parameters on every rank, split ones gathered) must be one process's.
    It catches what the plan's rules miss, such as a parameter whose gradient is only this
    rank's part (the forward is right, the ranks' copies drift apart as they train)."""
    got = _gradients(model, derivation.inputs, list(reference))
    # A gradient that is zero in exact arithmetic (a key bias: softmax ignores it) holds
    # rounding noise only, which the split sums in another order: each gradient is
    # measured against at least a thousandth of the largest one.
    largest = max((g.abs().max().item() for g in reference.values() if g is not None), default=0)
    problem = ""
    for name, want in reference.items():
        have = got.get(name)
        if (want is None) != (have is None):
            problem = f"{name} gets a gradient in {'one' if have is None else 'neither'} run"
        elif want is not None and have is not None:
            rtol = {torch.float64: 1e-6, torch.float32: 1e-3}.get(want.dtype, 5e-2)
            scale = max(want.abs().max().item(), 1e-3 * largest)
            if have.shape != want.shape:
                problem = (
                    f"{name}'s gradient has shape {tuple(have.shape)}, not {tuple(want.shape)}"
                )
            elif (off := (have - want).abs().max().item()) > rtol * scale:
                problem = f"{name}'s gradient is {off:.3g} off one process's (of {scale:.3g})"
        if problem:
            break
    problems = [""] * mesh.size()
    dist.all_gather_object(problems, problem, group=mesh.get_group())
    problem = next((p for p in problems if p), "")
    if problem:
        raise MeshfitError(
            f"tensor parallel split {type(model).__name__} as derived "
            f"({_plan_summary(derivation.plan)}) and on the traced input {problem}; pass a "
            f"tp_plan, or use dp, fsdp or pp"
        )


def _sum_gradients_over_tp(model: nn.Module, mesh: DeviceMesh, names: list[str]) -> None:
    """Give each parameter in `names` to its module's forward through Megatron's f
    (_CopyToTP: the same value; in backward, the gradient summed over the tp ranks).
    It happens where the parameter is used, so it holds under FSDP2 (which hands the
    forward an unsharded copy) and DDP alike, and in every micro-batch."""
    modules = dict(model.named_modules())
    owners: dict[str, list[str]] = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    for owner, leaves in owners.items():
        modules[owner]._tp_summed_gradients = tuple(leaves)
    group = mesh.get_group()
    rebind_forwards([modules[o] for o in owners], lambda inner: _summing(inner, group))


def _summing(inner: Any, group: Any) -> Any:
    """`inner` (a forward of (module, ...)) run with its module's `_tp_summed_gradients`
    parameters seen through _CopyToTP."""

    @functools.wraps(inner)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        held = {n: self._parameters[n] for n in self._tp_summed_gradients}
        try:
            for n, p in held.items():
                self._parameters[n] = _CopyToTP.apply(p, group)
            return inner(self, *args, **kwargs)
        finally:
            self._parameters.update(held)

    return forward


def _plan_summary(plan: dict[str, str]) -> str:
    leaves: dict[str, str] = {}
    for name, style in plan.items():
        leaves.setdefault(name.rsplit(".", 1)[-1], style)
    return ", ".join(f"{leaf}: {style}" for leaf, style in leaves.items())


_SHARES: weakref.WeakKeyDictionary[nn.Module, dict[str, float]] = weakref.WeakKeyDictionary()
# {model: {module inside a block, or a head outside them: why tp left its weights whole}}
_WHOLE: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
# {model: {Linear outside the blocks split over its outputs, then gathered: output count}}
_HEADS: weakref.WeakKeyDictionary[nn.Module, dict[str, int]] = weakref.WeakKeyDictionary()


def tp_share(model: nn.Module, plan: dict[str, str]) -> dict[str, float]:
    """{block class name: fraction of that kind of block's parameters (by count) that
    `plan` splits over the tp ranks}: a column-parallel weight and bias, a row-parallel
    weight (its bias stays whole on every rank)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    split: dict[str, int] = {}
    total: dict[str, int] = {}
    if type(model) is nn.Sequential:  # its layers are the pairs: one kind, the model
        units = [("", model)]
    else:
        units = _block_units(model, find_blocks(model))
    for unit, block in units:
        kind = type(block).__name__
        total[kind] = total.get(kind, 0) + sum(p.numel() for p in block.parameters())
        prefix = f"{unit}." if unit else ""
        for name, style in plan.items():
            if name.startswith(prefix):
                split[kind] = split.get(kind, 0) + split_numel(modules, params, name, style)
    return {kind: split.get(kind, 0) / n for kind, n in total.items() if n}


def split_numel(
    modules: dict[str, nn.Module], params: dict[str, nn.Parameter], name: str, style: object
) -> int:
    """Parameter elements plan entry `name` splits: a column-parallel weight and bias, a
    row-parallel weight (its bias stays whole), an experts' weight parameter."""
    if name in params and name not in modules:  # an experts' weight parameter
        return params[name].numel()
    module = modules.get(name)
    if module is None or getattr(module, "weight", None) is None:
        return 0
    count = module.weight.numel()
    bias = getattr(module, "bias", None)
    if str(style).startswith("colwise") and bias is not None:
        count += bias.numel()
    return count


def describe_tp(model: nn.Module) -> str | None:
    """One line on what tensor parallel split in `model` (None: not split by a derived
    plan), e.g. "tp splits 99.6% of GPT2Block parameters"."""
    share = _SHARES.get(model)
    if not share:
        return None
    parts = ", ".join(f"{100 * v:.1f}% of {k} parameters" for k, v in share.items())
    heads = "".join(
        f" and {name} over its {n} outputs (gathered)" for name, n in _HEADS.get(model, {}).items()
    )
    whole = _WHOLE.get(model, {})
    kept = "".join(f"; {owner} kept whole: {why}" for owner, why in sorted(whole.items()))
    return f"tensor parallel splits {parts}{heads}{kept}"


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the input's gradient summed over the tp ranks
    (each rank's column slice contributes its part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the row-parallel partial products summed over the tp ranks; the
    gradient passes through (it is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _LocalShard(ParallelStyle):
    """Column- or row-parallel for what torch's styles do not take: HF's Conv1D (weight
    stored (in, out)), and fused projections whose output is N chunks (q|k|v) each
    split over the ranks. A fused weight is a DTensor with `_StridedShard(dim, N)`: rank
    r holds [q_r, k_r, v_r], and its full tensor is the one-process layout, so gathered
    state dicts keep it. The forward runs on the local shards with Megatron's f / g."""

    def __init__(self, style: str, chunks: int = 1) -> None:
        super().__init__()
        self.style, self.chunks = style, chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        conv1d = _is_conv1d(module)
        out_dim = 1 if conv1d else 0  # the weight dimension of the output features
        col = self.style == "colwise"
        dim = out_dim if col else 1 - out_dim

        def placement(d: int):
            return _StridedShard(d, split_factor=self.chunks) if self.chunks > 1 else Shard(d)

        w = module.weight
        module.weight = nn.Parameter(
            distribute_tensor(w.data, device_mesh, [placement(dim)]), w.requires_grad
        )
        bias = getattr(module, "bias", None)
        if bias is not None:
            layout = [placement(0)] if col else [Replicate()]
            module.bias = nn.Parameter(
                distribute_tensor(bias.data, device_mesh, layout), bias.requires_grad
            )
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight.to_local()
            b = module.bias.to_local() if module.bias is not None else None
            if col:
                x = _CopyToTP.apply(x, group)
            y = x @ weight if conv1d else x @ weight.t()
            if not col:
                y = _ReduceFromTP.apply(y, group)
            return y if b is None else y + b

        module.forward = forward
        return module

    def __repr__(self) -> str:
        chunks = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return f"_LocalShard({self.style}{chunks})"


class _WeightShard(ParallelStyle):
    """Megatron's split of the weight parameters a module multiplies itself (a mixture of
    experts' 3-D gate_up_proj and down_proj): each named weight sharded on its output
    features (column-parallel; chunk by chunk for a fused gate|up, so each rank keeps
    matching halves of gate and of up) or its input features (row-parallel). The
    module's own forward runs on the local shards: its floating-point inputs through f
    (their gradients summed over the tp ranks), the outputs holding its row-parallel
    products through g. One all-reduce after all experts, in forward and in backward."""

    def __init__(self, weights: dict[str, tuple[str, int, int]], reduce: tuple[int, ...]) -> None:
        super().__init__()
        self.weights, self.reduce = weights, reduce  # {name: (style, dim, chunks)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        for name, (_, dim, chunks) in self.weights.items():
            w = getattr(module, name)
            layout = _StridedShard(dim, split_factor=chunks) if chunks > 1 else Shard(dim)
            sharded = distribute_tensor(w.data, device_mesh, [layout])
            setattr(module, name, nn.Parameter(sharded, w.requires_grad))
        group, names, reduce = device_mesh.get_group(), tuple(self.weights), set(self.reduce)
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = map_tensors(
                (args, kwargs),
                lambda t: _CopyToTP.apply(t, group) if t.is_floating_point() else t,
            )
            with _local_weights(module, names):
                out = original(*args, **kwargs)
            position = itertools.count()

            def summed(t: torch.Tensor) -> torch.Tensor:
                if not t.is_floating_point():
                    return t
                return _ReduceFromTP.apply(t, group) if next(position) in reduce else t

            return map_tensors(out, summed)

        module.forward = forward
        return module

    def __repr__(self) -> str:
        return f"_WeightShard({self.weights})"


@contextlib.contextmanager
def _local_weights(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """`module`'s sharded weights `names` seen by its forward as their local shards
    (differentiable: the gradient reaches the sharded parameter), read at call time so
    FSDP2's unsharded parameters are the ones used."""
    held = {n: module._parameters[n] for n in names}
    try:
        for n, p in held.items():
            module._parameters[n] = p.to_local() if isinstance(p, DTensor) else p
        yield
    finally:
        module._parameters.update(held)


@torch.no_grad()
def _broadcast_replicated(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy tp rank 0's values of every unsharded parameter and buffer to the other tp
    ranks, so replicas start identical however each process initialised its model."""
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        if not isinstance(tensor, DTensor):
            dist.broadcast(tensor.data, src=src, group=group)


def _share_random_state(mesh: DeviceMesh) -> None:
    """Give every tp rank tp rank 0's random-number state (CPU, and the GPU's when one is
    in use): the ranks compute the same replicated activations, so their dropout must
    draw the same masks, whatever seed each process set (a script seeding by rank made
    the tp ranks' copies of the replicated weights drift apart). `fit` seeds the same way
    (Topology.random_stream)."""
    group = mesh.get_group()
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if on_gpu else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(states[0])
    if on_gpu and states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def _is_strided(t: object) -> bool:
    """A DTensor that tensor parallel split chunk by chunk: a `_StridedShard` on the tp
    mesh dimension. FSDP2 over tp-split parameters uses `_StridedShard` on its own
    dimension too; DCP saves and loads those as they are, and re-laying them out here
    broke exact resume of dp x tp x pp with AdamW (measured: losses apart from the
    second step after the resume)."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(
        type(p).__name__ == "_StridedShard" and (names[i] if i < len(names) else "tp") == "tp"
        for i, p in enumerate(t.placements)
    )


def strided_as_replicated(tree: Any, pairs: list | None = None) -> Any:
    """`tree` (a state dict, nested dicts/lists) with every DTensor split chunk by chunk
    (a fused q|k|v under tp) replaced by a replicated copy: DCP cannot plan a save of
    `_StridedShard` chunks (torch 2.13: "overlapping chunks"). The copy holds the
    one-process layout, so the checkpoint is the same as from any other plan. `pairs`
    collects (original, copy) for `copy_back_strided` after a load."""
    from torch.distributed.tensor import Replicate

    if _is_strided(tree):
        copy = tree.redistribute(placements=[Replicate()] * len(tree.placements))
        if pairs is not None:
            pairs.append((tree, copy))
        return copy
    if isinstance(tree, dict):
        return {k: strided_as_replicated(v, pairs) for k, v in tree.items()}
    if isinstance(tree, list):
        return [strided_as_replicated(v, pairs) for v in tree]
    return tree


@torch.no_grad()
def copy_back_strided(pairs: list) -> None:
    """Copy the loaded replicated values into the strided DTensors they stand for."""
    from torch.distributed.tensor import distribute_tensor

    for original, copy in pairs:
        full = copy.to_local()
        local = distribute_tensor(full, original.device_mesh, original.placements).to_local()
        original.to_local().copy_(local)
