"""The trace tensor parallel derives its plan from: one forward on a tiny input, every
tensor computed inside a block labelled with the block input and the projections it came
from (_Flow), one _BlockTrace per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from meshfit.errors import MeshfitError
from meshfit.parallel.tensor.split import _is_channel_layer, _is_conv, _is_projection
from meshfit.trees import call_model, tensors_in


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
    # {per-channel layer (BatchNorm): the labels of its input}
    channel_layers: dict[str, frozenset[str]] = field(default_factory=dict)


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
        # convolutions' outputs: their features (channels) are dimension 1, not the last
        self.channels_first: set[str] = set()
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
        if args and isinstance(args[0], torch.Tensor):
            x = args[0]
            for label in self.labels.get(id(x), frozenset()):
                at = 1 if label in self.channels_first and x.ndim > 2 else -1
                if not _reduces_dim(func, args, kwargs, at):
                    continue
                if x.shape[at] > 1 and x.shape[at] in self.widths.get(label, ()):
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


def _reduces_dim(func: Any, args: tuple, kwargs: dict, at: int) -> bool:
    """Whether `func` combines values along dimension `at` of its first argument (the
    features: the last, or a convolution's channels)."""
    name = getattr(func, "__name__", "")
    if name in _NORMS:
        return True
    if name not in _REDUCTIONS:
        return False
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None:
        return True  # over every dimension
    ndim = max(args[0].ndim, 1)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(isinstance(d, int) and d % ndim == at % ndim for d in dims)


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
    holding only such blocks: an encoder-decoder's two stacks (T5) both split. Then the
    blocks of every other stack outside them (not around them): a container of two or
    more modules of one other type, each holding two or more projections (Whisper's
    decoder layers, beside its encoder's): each kind is traced, split and reported as
    the first."""
    kind = type(stack.blocks[0])
    units = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not len(container):
            continue
        if all(type(child) is kind for child in container.children()):
            units += [(f"{name}.{k}" if name else k, b) for k, b in container._modules.items()]
    if not units:
        return [(stack.qualified(k), b) for k, b in zip(stack.keys, stack.blocks, strict=True)]
    inside = tuple(f"{unit}." for unit, _ in units)
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        if f"{name}.".startswith(inside) or name + "." in inside:
            continue
        if not name or any(unit.startswith(f"{name}.") for unit in inside):
            continue  # around blocks already found (timm ConvNeXt's stages): as units
            # too, their projections were recorded twice and never classified
        children = list(container.children())
        if len({type(c) for c in children}) != 1 or type(children[0]) is kind:
            continue
        if all(sum(_is_projection(m) for m in c.modules()) >= 2 for c in children):
            added = [(f"{name}.{k}" if name else k, b) for k, b in container._modules.items()]
            units += added
            inside += tuple(f"{unit}." for unit, _ in added)
    return units


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
            # name, or positionally with the same batch and width: Whisper's encoder
            # output has its own length): replicated on every tp rank
            streams = [
                t
                for t in tensors_in(args)
                if t.shape == hidden.shape
                or (
                    t.ndim == hidden.ndim >= 2
                    and t.shape[0] == hidden.shape[0]
                    and t.shape[-1] == hidden.shape[-1]
                )
            ]
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
            features = -1
            if _is_conv(module) and output.ndim > 2:  # (batch, channels, *positions)
                features = 1
                flow.channels_first.add(call.name)
            flow.widths[call.name] = {output.shape[features]}
            flow.fresh[id(output)] = call

    def after_owner(module: nn.Module, args: tuple, output: Any) -> None:
        if current:
            _, flow, trace = current[-1]
            trace.modules[names[id(module)]] = module
            labels = [flow.label(t) for t in tensors_in(output) if t.is_floating_point()]
            trace.owner_outputs[names[id(module)]] = labels

    def after_channel_layer(module: nn.Module, args: tuple, output: Any) -> None:
        if current:
            _, flow, trace = current[-1]
            name = names[id(module)]
            trace.modules[name] = module
            trace.channel_layers[name] = flow.label(args)

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
            elif _is_channel_layer(module):
                handles.append(module.register_forward_hook(after_channel_layer))
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
