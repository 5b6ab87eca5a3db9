"""What a model costs, per sample, found by running its forward once.

The forward runs where the model lives: on the `meta` device a 175B model is profiled
with no memory and in seconds (every op computes shapes only). While it runs, three
PyTorch tools watch it:

- `FlopCounterMode` counts the FLOPs of the matrix products and attention (and of the
  grouped products MoE experts run, parallel/flop_counts.py);
- `saved_tensors_hooks` sees every tensor autograd keeps for backward: the activation
  memory (parameters excluded, each storage counted once);
- a dispatch mode notes the outputs that "selective" recomputation keeps (the same op
  list as `parallel/recompute.py`).

Each is attributed to what was running: the part before the first block ("head"), a
block, or the part after the last block and the loss ("tail"). A saved tensor whose last
dimension is not the block's width (attention heads, the MLP's inner width) is one that
tensor parallel splits; the block-wide ones (norm inputs, the residual stream) stay whole
on every tp rank (Korthikanti et al. 2022 count the same way).

On `meta`, `scaled_dot_product_attention` would take its unfused math path and keep a
sequence x sequence score matrix that no real run keeps: the profile runs it as the fused
memory-efficient kernel instead (what CPU and GPU runs use), whose meta kernel and FLOP
count PyTorch ships.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.context import why_not_cut
from meshfit.parallel.experts import find_expert_layers
from meshfit.parallel.flop_counts import flop_counter
from meshfit.parallel.recompute import _SAVE as SELECTIVE_KEEPS
from meshfit.planner.fused_attention import FusedAttention
from meshfit.planner.parameters import count_parameters, tied_parameters
from meshfit.trees import map_tensors, slice_rows, tensors_in


@dataclass
class PartCost:
    """One part of the model (a block, the head or the tail), per sample."""

    params: int = 0  # parameter elements
    trains: bool = True  # holds a parameter that requires grad (a pipeline stage needs one)
    flops: float = 0.0  # forward FLOPs (matrix products and attention)
    attention_flops: float = 0.0  # the attention part of `flops` (split with the heads)
    saved: float = 0.0  # bytes autograd keeps for backward (not parameters)
    saved_split: float = 0.0  # the part of `saved` tensor parallel splits
    kept_selective: float = 0.0  # bytes "selective" recomputation keeps
    kept_selective_split: float = 0.0
    input_bytes: float = 0.0  # the part's input ("full" recomputation keeps it; stages send it)
    attention_kv_bytes: float = 0.0  # keys and values its attention reads (cp gathers them)
    expert_params: int = 0  # elements of its experts' weights (of `params`; ep places them)
    # of `flops`, `saved_split` and `kept_selective_split`: what its experts modules do and
    # keep (beside ep, tp leaves the experts whole: every tp rank computes and keeps them)
    expert_flops: float = 0.0
    expert_saved_split: float = 0.0
    expert_kept_split: float = 0.0
    # bytes a compiled step saves for backward (planner/compiled_memory.py), in the compute
    # dtype it was traced in; None: not traced
    compiled_saved: float | None = None
    compiled_saved_split: float = 0.0
    dispatch_bytes: float = 0.0  # its (token, expert) pairs' hidden states (ep sends them)
    tp_share: float = 0.0  # fraction of `params` tensor parallel splits
    tp_reductions: int = 0  # all-reduces of a tp forward (row-parallel outputs)
    tp_projections: int = 0  # layers tp splits (each a DTensor dispatch, forward and backward)
    # of tp_reductions and tp_projections: its experts modules' (beside ep tp leaves them)
    expert_tp_reductions: int = 0
    expert_tp_projections: int = 0
    # a head tp splits over its outputs and gathers (tensor.gathered_heads): its output
    # count, which tp must divide (else it stays whole); 0: none
    tp_gathered_outputs: int = 0
    ops: int = 0  # operators its forward runs (each costs a fixed launch / dispatch time)
    largest_param: int = 0  # elements of its largest parameter (the optimizer's temporaries)
    largest_expert: int = 0  # and of its largest expert weight (ep divides it, fsdp the rest)


@dataclass
class ModelProfile:
    """A model's costs per sample, as the planner needs them."""

    name: str
    blocks: list[PartCost]
    head: PartCost
    tail: PartCost
    total_params: int  # every parameter once (tied ones once)
    tied_params: int  # used before and after the blocks: on the first and the last stage
    output_bytes: float  # the model's output per sample (its gradient is a temporary)
    tokens_per_sample: int
    param_bytes: int  # element size of the parameters (4: fp32)
    # of tail.saved: what the loss keeps over the vocabulary (a log-softmax), which
    # autocast computes in float32 (torch's autocast op lists)
    loss_float32: float = 0.0
    # the loss (or the model) saves the output itself for backward (a mean-squared
    # error does; a cross-entropy saves its log-softmax): counted in tail.saved already
    output_saved: bool = False
    tp_error: str | None = None  # why tensor parallel cannot split this model
    experts: int = 0  # experts per mixture-of-experts layer (the fewest; 0: none)
    pp_error: str | None = None  # why meshfit's pipeline cut refuses it
    own_weights_error: str | None = None  # why FSDP2 (and tp) cannot replace its weights
    has_batchnorm: bool = False  # micro-batches would each be normalised alone
    split_error: str | None = None  # why no plan may split the batch (a coupled loss, ...)
    cp_error: str | None = None  # why context parallel cannot cut its sequences
    max_tp: int = 1 << 30  # head counts and widths tp must divide
    block_kind: str = ""
    # how the user built it: on meta each rank builds only its part; else every rank
    # holds the whole model before the forms split it
    built_on_meta: bool = False
    largest_param: int = 0  # elements of the largest parameter (materialize's scratch)
    # the compiled partition's counts (PartCost.compiled_saved): traced under bf16
    # autocast or not (None: not traced), or why the trace failed
    compiled_autocast: bool | None = None
    compiled_error: str | None = None
    # where a pipeline stage may start: the blocks given what the first blocks are
    # (pipeline/arguments.py), and the first block that differs, said; None: anywhere
    stage_starts: list[bool] | None = None
    stage_starts_differing: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def block_params(self) -> int:
        return sum(b.params for b in self.blocks)


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any, Any], Any] | str | None = None,
    example_targets: Any = None,
    tp: bool = True,
) -> ModelProfile:
    """Run `model` forward on `example_inputs` (any batch size; on the model's device,
    `meta` included) and return its costs per sample. With `loss_fn` and
    `example_targets` the loss runs too; without them a floating output is taken to be
    logits, whose cross-entropy keeps a float32 copy (log-softmax) for backward."""
    from meshfit.weights.keras import read_weights_from_modules

    read_weights_from_modules(model)  # as prepare does: a Keras model's forms see the same
    if not tensors_in(example_inputs):
        raise MeshfitError("planning needs example_inputs: one batch of the model's inputs")
    _device_of(model)
    try:  # on meta: no memory, no time, the same shapes
        profile = _profile(model, example_inputs, loss_fn, example_targets, on_meta=True)
    except Exception as error:
        if _device_of(model).type == "meta":
            raise MeshfitError(
                f"cannot plan {type(model).__name__} on the meta device: its forward failed "
                f"there ({type(error).__name__}: {str(error).splitlines()[0][:200]}); build "
                f"the model on the CPU (a smaller config of it plans the same per block)"
            ) from error
        # Data-dependent code (.item(), a mask check) cannot run on meta: run the real model.
        profile = _profile(model, example_inputs, loss_fn, example_targets, on_meta=False)
        profile.notes.append(f"profiled on {_device_of(model)}: its forward cannot run on meta")
    stack = _blocks_or_none(model)
    profile.has_batchnorm = any(isinstance(m, _BatchNorm) for m in model.modules())
    if _device_of(model).type != "meta":  # on meta no buffer holds a value to compare
        from meshfit.coupling.batch import planned_refusal

        profile.split_error = planned_refusal(model, example_inputs, loss_fn, example_targets)
    profile.cp_error = why_not_cut(model)
    profile.built_on_meta = _device_of(model).type == "meta"
    profile.largest_param = max((p.numel() for p in model.parameters()), default=0)
    if stack is None:
        profile.tp_error = profile.pp_error = (
            f"{type(model).__name__} has no stack of repeated blocks to split or cut"
        )
        return profile
    profile.pp_error = _pipeline_refusal(model, stack, example_inputs, profile)
    if profile.pp_error is None:
        from meshfit.coupling.moe import refused_under_pipeline

        profile.pp_error = refused_under_pipeline(model)
    if profile.own_weights_error:
        profile.tp_error = profile.own_weights_error
    elif tp:
        _tensor_parallel_costs(model, stack, example_inputs, profile)
    return profile


def _blocks_or_none(model: nn.Module) -> Any:
    try:
        return find_blocks(model)
    except MeshfitError:
        return None


def _pipeline_refusal(
    model: nn.Module, stack: Any, example_inputs: Any, profile: ModelProfile
) -> str | None:
    """Why meshfit's pipeline cut would refuse the model (its pre-flight checks, on one
    forward: a block that reads more than the previous block's output, a module outside
    the blocks run between them), or None; and where a stage may start, into `profile`
    (the blocks' arguments, read on the same forward as the cut reads them)."""
    from meshfit.parallel.pipeline.arguments import (
        allowed_starts,
        arguments_on_meta,
        recorded_arguments,
    )
    from meshfit.parallel.pipeline.cut import _checked, _head_tail_parameters

    head, tail = _head_tail_parameters(model, stack)
    inputs = _first_samples(example_inputs, 1)
    n = len(stack.blocks)
    for on_meta in (True, False):
        if not on_meta and _device_of(model).type == "meta":
            # no real forward to check on (the profile ran on meta): the blocks'
            # arguments from the prologue alone, as the cut reads them for such a model
            given = arguments_on_meta(model, stack, inputs)
            profile.stage_starts, profile.stage_starts_differing = allowed_starts(given, n, None)
            return None
        device = torch.device("meta") if on_meta else _device_of(model)
        moved = map_tensors(inputs, lambda t, d=device: t.to(d))
        try:  # with autograd on: a side input that needs a gradient is one of the refusals
            with recorded_arguments(stack) as given, _checked(model, stack, head, tail) as found:
                # the stand-ins made inside: they take the check's requires_grad
                state = _meta_state(model) if on_meta else _clones(model)
                _call_functional(model, state, moved)
            starts = allowed_starts(given, n, found.carried)
            profile.stage_starts, profile.stage_starts_differing = starts
            return None
        except MeshfitError as error:
            return str(error).split(";")[0]
        except Exception:
            continue  # meta cannot run it: the real forward next
    return None


def _profile(
    model: nn.Module, example_inputs: Any, loss_fn: Any, example_targets: Any, on_meta: bool
) -> ModelProfile:
    stack = _blocks_or_none(model) or _NoBlocks()
    device = torch.device("meta") if on_meta else _device_of(model)
    inputs = map_tensors(example_inputs, lambda t: t.to(device))
    targets = map_tensors(example_targets, lambda t: t.to(device))
    first = tensors_in(inputs)
    samples = first[0].shape[0]
    tokens = first[0].shape[1] if first[0].dim() == 2 and not first[0].is_floating_point() else 1

    # Stand-ins for the weights (meta tensors, or clones: the user's own weights and
    # BatchNorm statistics are never touched). A forward that still reads the originals
    # keeps its own references to them, past the module's: FSDP2 and tp, which replace a
    # module's parameters, would then train nothing (Keras layers do this).
    state = _meta_state(model) if on_meta else _clones(model)
    params = {t.untyped_storage()._cdata for t in state.values()}
    originals = {p.untyped_storage()._cdata for p in model.parameters()}
    own_weights = [False]
    keys = list(stack.keys)
    parts: dict[str, PartCost] = {k: PartCost() for k in ["head", *keys, "tail"]}
    current = ["head"]
    width: dict[str, int] = {}
    seen: set[int] = set()
    tail_saved: list[tuple[int, int]] = []  # (last dimension, bytes) the tail keeps
    counter = flop_counter()
    flops_at = [0.0, 0.0]  # total, attention: when the current part began

    def totals() -> tuple[float, float]:
        counts = counter.get_flop_counts().get("Global", {})
        attention = sum(v for op, v in counts.items() if "scaled_dot_product" in str(op))
        return float(sum(counts.values())), float(attention)

    def switch(to: str) -> None:
        total, attention = totals()
        part = parts[current[0]]
        part.flops += total - flops_at[0]
        part.attention_flops += attention - flops_at[1]
        flops_at[:] = [total, attention]
        current[0] = to

    def before(key: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            switch(key)
            found = tensors_in((args, kwargs))
            if found:
                width[key] = found[0].shape[-1] if found[0].dim() else 1
                parts[key].input_bytes += _nbytes(found[0])

        return hook

    def after(key: str, nxt: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            switch(nxt)

        return hook

    in_experts = [False, 0.0]  # inside an experts module; the FLOP count when it began

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()._cdata
        if storage in originals and not on_meta:
            own_weights[0] = True
        if storage in params or storage in seen or storage in originals:
            return t
        seen.add(storage)
        part = parts[current[0]]
        size = t.untyped_storage().nbytes()
        part.saved += size
        if _splits(t, width.get(current[0])):
            part.saved_split += size
            part.expert_saved_split += size if in_experts[0] else 0
        if current[0] == "tail" and t.dim() >= 2:
            tail_saved.append((t.shape[-1], size))
        return t

    def kept(t: torch.Tensor | None) -> None:
        part = parts[current[0]]
        if t is None:  # any operator: count it
            part.ops += 1
            return
        if current[0] in ("head", "tail"):
            return
        part.kept_selective += _nbytes(t)
        if _splits(t, width.get(current[0])):
            part.kept_selective_split += _nbytes(t)
            part.expert_kept_split += _nbytes(t) if in_experts[0] else 0

    handles = []
    for layer in find_expert_layers(model):  # expert parallel's traffic: the pairs it sends

        def dispatched(module: nn.Module, args: tuple) -> None:
            in_experts[:] = [True, totals()[0]]
            if len(args) >= 2 and torch.is_tensor(args[0]) and torch.is_tensor(args[1]):
                pairs = args[1].numel()
                parts[current[0]].dispatch_bytes += (
                    pairs * args[0].shape[-1] * args[0].element_size()
                )

        def returned(module: nn.Module, args: tuple, output: Any) -> None:
            parts[current[0]].expert_flops += totals()[0] - in_experts[1]
            in_experts[0] = False

        handles.append(layer.module.register_forward_pre_hook(dispatched))
        handles.append(layer.module.register_forward_hook(returned))
    for i, (key, block) in enumerate(zip(keys, stack.blocks, strict=True)):
        nxt = keys[i + 1] if i + 1 < len(keys) else "tail"
        handles.append(block.register_forward_pre_hook(before(key), with_kwargs=True))
        handles.append(block.register_forward_hook(after(key, nxt), with_kwargs=True))
    was_training = model.training
    model.train()

    def attended(nbytes: int) -> None:
        parts[current[0]].attention_kv_bytes += nbytes

    attention = FusedAttention(on_meta, counter, attended)
    try:
        with (
            _repeats_skipped(stack, active=on_meta) as repeats,
            torch.enable_grad(),
            counter,
            attention,
            _SelectiveOutputs(kept),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            outputs = _call_functional(model, state, inputs)
            output_bytes = sum(_nbytes(t) for t in tensors_in(outputs) if t.is_floating_point())
            _run_loss(loss_fn, outputs, targets, pack)
            switch("tail")
        output_saved = any(
            t.untyped_storage()._cdata in seen for t in tensors_in(outputs) if t.is_floating_point()
        )
        floating = [t for t in tensors_in(outputs) if t.is_floating_point() and t.dim() >= 2]
        vocabulary = floating[0].shape[-1] if floating else None
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for key, source in repeats.items():
        parts[key] = dataclasses.replace(parts[source])

    count_parameters(model, stack, parts)
    tied = tied_parameters(model, stack) if keys else 0
    return ModelProfile(
        name=type(model).__name__,
        blocks=[_per_sample(parts[k], samples) for k in keys],
        head=_per_sample(parts["head"], samples),
        tail=_per_sample(parts["tail"], samples),
        total_params=sum(p.numel() for p in model.parameters()),
        tied_params=tied,
        output_bytes=output_bytes / samples,
        output_saved=output_saved,
        loss_float32=sum(n for last, n in tail_saved if last == vocabulary) / samples,
        tokens_per_sample=tokens,
        experts=min((layer.experts for layer in find_expert_layers(model)), default=0),
        param_bytes=next(model.parameters()).element_size(),
        block_kind=type(stack.blocks[0]).__name__ if keys else "",
        own_weights_error=(
            f"{type(model).__name__}'s forward reads its weights through references of "
            f"its own, not its modules' parameters, which FSDP2 and tp replace"
            if own_weights[0]
            else None
        ),
    )


class _NoBlocks:
    """A model without a stack of blocks: all of it is the head."""

    name = ""
    keys: list[str] = []
    blocks: list[nn.Module] = []


def _clones(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter (requiring grad as the original) and buffer."""
    return _stand_ins(model, lambda t: t.detach().clone())


def _meta_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Meta stand-ins for every parameter and buffer (tied ones shared)."""
    return _stand_ins(model, lambda t: torch.empty_like(t, device="meta"))


def _stand_ins(
    model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """{name: make(tensor)} for every parameter and buffer, a tensor shared under several
    names (tied weights) made once; a parameter's stand-in requires grad as it does."""
    state: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False)]
    named += [*model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) not in made:
            stand_in = make(t)
            if isinstance(t, nn.Parameter):
                stand_in.requires_grad_(t.requires_grad)
            made[id(t)] = stand_in
        state[name] = made[id(t)]
    return state


def _call_functional(model: nn.Module, state: dict[str, torch.Tensor], inputs: Any) -> Any:
    from collections.abc import Mapping

    if isinstance(inputs, Mapping):
        return torch.func.functional_call(model, state, args=(), kwargs=dict(inputs))
    return torch.func.functional_call(model, state, args=(inputs,))


@contextlib.contextmanager
def _repeats_skipped(stack: Any, active: bool = True) -> Iterator[dict[str, str]]:
    """Blocks the same as an earlier one (class and parameter shapes) skip their forward
    and hand on the first one's output: on meta they would cost what the first of their
    kind costs, and a 96-layer model profiles as fast as a 1-layer one. Yields
    {repeated block's key: the first one's key}; the blocks are as before afterwards."""
    first: dict[tuple, str] = {}
    repeats: dict[str, str] = {}
    for key, block in zip(stack.keys, stack.blocks, strict=True) if active else ():
        shapes = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
        signature = (type(block), shapes)
        repeats[key] = first.setdefault(signature, key)
    repeats = {k: v for k, v in repeats.items() if k != v}
    outputs: dict[str, Any] = {}
    handles = []
    for key in set(repeats.values()):

        def remember(module, args, kwargs, output, _key=key):
            outputs[_key] = output

        block = stack.container._modules[key]
        handles.append(block.register_forward_hook(remember, with_kwargs=True))
    own: dict[str, Any] = {}  # a forward set on the block itself (a wrapper), kept
    for key, source in repeats.items():
        block = stack.container._modules[key]
        if "forward" in vars(block):
            own[key] = vars(block)["forward"]
        block.forward = lambda *args, _source=source, **kwargs: outputs[_source]
    try:
        yield repeats
    finally:
        for h in handles:
            h.remove()
        for key in repeats:
            block = stack.container._modules[key]
            del block.forward  # the class's own forward again, or the block's own:
            if key in own:
                block.forward = own[key]


def _run_loss(loss_fn: Any, outputs: Any, targets: Any, pack: Callable) -> None:
    if callable(loss_fn) and targets is not None:
        loss_fn(outputs, targets)
        return
    if loss_fn == "model":
        return  # the model computed its loss in its forward (labels among its inputs)
    logits = [t for t in tensors_in(outputs) if t.is_floating_point()]
    if logits and logits[0].dim() >= 2:
        # cross-entropy's log-softmax, in float32, kept for backward
        pack(torch.empty(logits[0].shape, dtype=torch.float32, device="meta"))


def _tensor_parallel_costs(
    model: nn.Module, stack: Any, example_inputs: Any, profile: ModelProfile
) -> None:
    """The share of each block tp splits and its all-reduces, from the plan meshfit
    would derive (parallel/tensor/), or why it cannot split the model."""
    from meshfit.parallel import tensor
    from meshfit.parallel.tensor.split import largest_tp

    on_meta = _device_of(model).type == "meta"
    try:
        with _repeats_skipped(stack, active=on_meta) as repeats:
            sample = _first_samples(example_inputs, 1)
            plan = tensor.derive_tp_plan(model, sample)
            # a Sequential's derived plan has no head of its own (apply_tensor_parallel)
            heads = {} if type(model) is nn.Sequential else tensor.gathered_heads(model, sample)[0]
    except MeshfitError as error:
        profile.tp_error = str(error).split(";")[0]
        return
    except Exception as error:  # the trace itself failed: planning goes on without tp
        profile.tp_error = f"tracing for tensor parallel failed ({type(error).__name__})"
        return
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    experts = [f"{layer.name}." for layer in find_expert_layers(model)]
    for key, part in zip(stack.keys, profile.blocks, strict=True):
        prefix = f"{stack.qualified(repeats.get(key, key))}."
        mine = {n: s for n, s in plan.items() if n.startswith(prefix)}
        split = sum(tensor.split_numel(modules, params, n, s) for n, s in mine.items())
        part.tp_share = split / part.params if part.params else 0.0
        part.tp_reductions = sum(1 for style in mine.values() if style == "rowwise")
        part.tp_projections = len(mine)
        theirs = [s for n, s in mine.items() if any(f"{n}.".startswith(e) for e in experts)]
        part.expert_tp_reductions = sum(1 for style in theirs if style == "rowwise")
        part.expert_tp_projections = len(theirs)
    profile.max_tp = largest_tp(model, plan)
    if heads and profile.tail.params:
        split = sum(tensor.split_numel(modules, params, name, "colwise") for name in heads)
        profile.tail.tp_share = split / profile.tail.params
        profile.tail.tp_projections = len(heads)
        profile.tail.tp_gathered_outputs = math.gcd(*heads.values())


def _first_samples(inputs: Any, n: int) -> Any:
    return slice_rows(inputs, 0, n)


# the PartCost fields that grow with the samples (the rest are per model)
_PER_SAMPLE = (
    "flops", "attention_flops", "saved", "saved_split", "kept_selective",
    "kept_selective_split", "input_bytes", "attention_kv_bytes", "dispatch_bytes",
    "expert_flops", "expert_saved_split", "expert_kept_split",
)  # fmt: skip


def _per_sample(part: PartCost, samples: int) -> PartCost:
    for name in _PER_SAMPLE:
        setattr(part, name, getattr(part, name) / samples)
    return part


def _splits(t: torch.Tensor, width: int | None) -> bool:
    return width is not None and t.dim() >= 2 and t.shape[-1] != width


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise MeshfitError(f"{type(model).__name__} has no parameters: there is nothing to plan")


# Operators besides views that launch no kernel.
_NO_KERNEL = {torch.ops.aten._unsafe_view.default, torch.ops.aten.detach.default}


class _SelectiveOutputs(TorchDispatchMode):
    """Reports every operator (with None) and the outputs of the ops "selective"
    recomputation keeps."""

    def __init__(self, report: Callable[[torch.Tensor | None], None]) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False) and func not in _NO_KERNEL:
            self.report(None)
        if func in SELECTIVE_KEEPS:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.report(t)
        return out
