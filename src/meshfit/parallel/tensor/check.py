"""Checks of a split: sizes tp must divide (before anything is split), and the split
model's outputs and gradients against tp rank 0's unsplit model on the traced input
(after), so a derived plan that changes the run is refused, never trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
)

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.placements import _shard, local_part
from meshfit.parallel.tensor.derivation import _Derivation
from meshfit.parallel.tensor.split import (
    HEAD_ATTRS,
    KV_HEAD_ATTRS,
    QKV_NAMES,
    Split,
    _dims,
    _is_channel_layer,
    _is_projection,
)
from meshfit.parallel.tensor.styles import _LocalShard
from meshfit.parallel.tensor.trace import _block_units, _first_line
from meshfit.trees import call_model, tensors_in


def check_tp_plan(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Refuse up front a plan that tp does not divide: sharded Linear dimensions, and
    the head count of any attention module whose projections are split. Pattern keys
    ("blocks.*.mlp.fc1", as torch's parallelize_module takes them) are checked for every
    module they match."""
    modules = dict(model.named_modules())
    plan = {
        name: _split_of(style) for key, style in plan.items() for name in _matching(modules, key)
    }
    for name, split in plan.items():
        module = modules.get(name)
        if isinstance(module, nn.Embedding) and split == Split("colwise"):
            if module.embedding_dim % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide {name}'s {module.embedding_dim} columns (a "
                    f"per-head table, split with the heads); use a tp that divides them"
                )
            continue
        if module is not None and _is_channel_layer(module) and split is not None:
            if module.num_features % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide {name}'s {module.num_features} channels (a "
                    f"per-channel layer, split with the convolutions around it); use a tp "
                    f"that divides them"
                )
            continue
        if module is None or not _is_projection(module) or split is None:
            continue
        fan_in, fan_out = _dims(module)
        chunks = split.chunks
        size, what = (fan_out, "output") if split.column else (fan_in, "input")
        if size % (tp * chunks):
            each = f" in each of its {chunks} fused parts" if chunks > 1 else ""
            raise MeshfitError(
                f"tp={tp} does not divide {name}'s {what} size {size // chunks}{each} "
                f"({split.kind}-parallel splits it); use a tp that divides {size // chunks}"
            )
    config = getattr(model, "config", None)
    attention = {}  # in plan order, so the first offender is named
    columns: dict[str, int] = {}
    for n, s in plan.items():
        if s is None or not s.column or "." not in n:
            continue
        owner, leaf = n.rsplit(".", 1)
        # a q/k/v name may keep its head count on the config; any other owner counts
        # only with a head count of its own (an MLP has none)
        attention.setdefault(owner, leaf in QKV_NAMES)
        columns[owner] = columns.get(owner, 0) + 1
    for name, use_config in attention.items():
        owner = modules.get(name)
        if owner is None:
            continue
        # q split alone: k and v stay whole on every rank (one key/value head, derive.py)
        counts = (HEAD_ATTRS, KV_HEAD_ATTRS) if columns[name] > 1 else (HEAD_ATTRS,)
        for attrs in counts:
            heads = _first_attr(owner, attrs)
            if heads is None and use_config:
                heads = _first_attr(config, attrs)
            if isinstance(heads, int) and heads % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide the {heads} attention heads of {name} (each "
                    f"rank must hold whole heads); use a tp that divides {heads}"
                )


def check_user_targets(model: nn.Module, plan: dict[str, Any]) -> None:
    """Refuse up front an entry of the user's tp_plan whose module tp cannot split by
    name: "colwise"/"rowwise" split a module's `weight` (a Linear, an Embedding, a
    Conv1D, a convolution, a fused projection), and a module without one (an experts
    module with weights of shape (experts, ...), a container) would fail inside the
    split with an AttributeError that names neither the entry nor the fix."""
    modules = dict(model.named_modules())
    for key, style in plan.items():
        if not isinstance(style, str) or Split.parse(style) is None:
            continue  # a ParallelStyle of torch's applies itself; a bad string is named later
        for name in _matching(modules, key):
            module = modules.get(name)
            if module is None or isinstance(getattr(module, "weight", None), torch.Tensor):
                continue
            if _is_channel_layer(module):
                continue
            held = dict(module.named_parameters(recurse=False))
            start = (
                f"tp_plan[{key!r}] = {style!r}: {name} ({type(module).__name__}) has no `weight`"
            )
            if held and all(p.dim() >= 3 for p in held.values()):
                raise MeshfitError(
                    f"{start}: its {list(held)} are experts' weights (experts, ...), which a "
                    f"tp_plan entry cannot split; leave it out of tp_plan (beside ep, ep places "
                    f"the experts whole), or give no tp_plan and meshfit derives the split"
                )
            what = f"its own parameters are {list(held)}" if held else "it holds none itself"
            raise MeshfitError(
                f"{start} to split ({what}); name the layers inside it that hold one, or "
                f"give no tp_plan and meshfit derives the split"
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


def _first_attr(obj: object, names: tuple[str, ...]) -> object:
    for attr in names:
        value = getattr(obj, attr, None)
        if value is not None:
            return value
    return None


def _check_weight_sizes(model: nn.Module, derivation: _Derivation, tp: int) -> None:
    params = dict(model.named_parameters())
    for name, how in derivation.weights.items():
        split = Split.parse(derivation.plan[name])
        kind, parts = split.kind, split.chunks
        dim = how.out_dim if split.column else how.in_dim
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
        if Split.parse(style).column
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
    choices = local_size_choices(derivation.local_attrs)
    tp = mesh.size()
    problem, failed_in = "", None
    for chosen in choices:
        for owner, attrs in derivation.local_attrs.items():
            for attr, value in attrs.items():
                setattr(modules[owner], attr, value // tp if attr in chosen else value)
        problem, failed_in = _compare(model, mesh, derivation.inputs, reference, scaled)
        if not problem:
            return
    rest = _plan_without(model, derivation, failed_in) if failed_in else None
    fix = "pass a tp_plan, or use dp, fsdp or pp"
    if rest:
        layer = _inside_block(find_blocks(model), failed_in)
        fix = (
            f"to split the rest alone (every block's {layer!r} whole on every tp rank), "
            f"pass tp_plan={rest!r}; or use dp, fsdp or pp"
        )
    raise MeshfitError(
        f"tensor parallel split {type(model).__name__} as derived "
        f"({_plan_summary(derivation.plan)}) and {problem}; {fix}"
    )


def local_size_choices(local_attrs: dict[str, dict[str, int]]) -> list[set[str]]:
    """The sets of stored-size names to try as local values, most localised first: every
    subset when there are few candidates (one forward each on a tiny input); with many,
    all of them or none."""
    names = sorted({attr for attrs in local_attrs.values() for attr in attrs})
    sizes = range(len(names), -1, -1) if len(names) <= 4 else (len(names), 0)
    return [set(chosen) for k in sizes for chosen in itertools.combinations(names, k)]


def _failing_module(model: nn.Module, error: BaseException) -> str | None:
    """The innermost module of `model` whose own code raised `error` (the last frame
    of the traceback that is a method of one of its modules), None when none is."""
    names = {id(m): n for n, m in model.named_modules()}
    found, tb = None, error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _plan_without(model: nn.Module, derivation: _Derivation, failed_in: str) -> dict | None:
    """The derived plan without the pairs inside `failed_in`'s kind of sub-layer (in
    every block), as a tp_plan a user passes ("<stack>.*.<layer>": style); None where the
    rest is empty or needs what a hand-written plan does not give (stored sizes made
    local, gradients summed over tp, experts' weights): meshfit does not check a
    user's tp_plan, so it names only plans that need nothing more."""
    stack = find_blocks(model)
    inner = _inside_block(stack, failed_in)
    if inner is None:
        return None

    def kept(name: str) -> bool:
        within = _inside_block(stack, name)
        return within is None or not (within == inner or within.startswith(inner + "."))

    if any(
        kept(n) for n in [*derivation.local_attrs, *derivation.weights, *derivation.summed]
    ) or any(kept(n) for n in derivation.summed_inputs):
        return None
    rest: dict[str, str] = {}
    for name, style in derivation.plan.items():
        within = _inside_block(stack, name)
        if not kept(name):
            continue
        if not isinstance(style, str):
            return None
        rest[stack.qualified("*") + "." + within if within is not None else name] = style
    return rest or None


def _inside_block(stack: Any, name: str) -> str | None:
    """`name` relative to the block holding it ("attn.c_attn"), None outside the blocks."""
    for key in stack.keys:
        block = stack.qualified(key)
        if name == block:
            return ""
        if name.startswith(block + "."):
            return name[len(block) + 1 :]
    return None


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """DTensor propagates shapes on fake tensors, whose module logs a failing op's whole
    traceback at ERROR level before it raises (SegFormer's split k_proj: 22 lines per
    rank) although the failure is caught here and said in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _compare(
    model: nn.Module,
    mesh: DeviceMesh,
    inputs: Any,
    reference: list[torch.Tensor],
    scaled: list[nn.Parameter],
) -> tuple[str, str | None]:
    """("", None) when the split model reproduces tp rank 0's `reference` outputs on
    `inputs`, else (what differs, the module whose forward failed or None): the same
    answer on every tp rank."""
    problem, failed_in = "", None
    try:
        with _fake_tensor_log_quiet():
            got = _outputs(model, inputs, scaled)
    except Exception as error:  # the same code on every rank: all fail alike
        failed_in = _failing_module(model, error)
        where = f" in {failed_in!r}" if failed_in else ""
        problem = f"its forward failed{where}: {type(error).__name__}: {_first_line(error)}"
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
    box = [(problem, failed_in)]
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
    # a split parameter's gradient stays a DTensor: the check compares each rank's part
    # (a pending sum is made whole here, on every rank alike: it is a collective)
    return {
        n: None if g is None else (g.full_tensor() if _pending(g) else g).detach()
        for n, g in zip(chosen, grads, strict=True)
    }


def _pending(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor with a placement other than a shard or a replica."""
    return isinstance(t, DTensor) and not all(
        _shard(p) or isinstance(p, Replicate) for p in t.placements
    )


@dataclass
class Reference:
    """One parameter's gradient in the unsplit run, as the backward check keeps it:
    whole, or (`local`) only this rank's part once the parameter is split (narrow), with
    what the check needs of the whole: its shape and its largest magnitude."""

    gradient: torch.Tensor
    shape: torch.Size
    largest: float
    local: bool = False


def reference_gradients(
    model: nn.Module, inputs: Any, names: list[str]
) -> dict[str, Reference | None]:
    """_gradients of the unsplit model, kept as References."""
    return {
        name: None if g is None else Reference(g, g.shape, _largest_magnitude(g))
        for name, g in _gradients(model, inputs, names).items()
    }


def _largest_magnitude(t: torch.Tensor) -> float:
    """max |t| without a temporary of t's size (a block's gradients are checked whole)."""
    if not t.numel():
        return 0.0
    low, high = t.aminmax()
    return max(-low.item(), high.item())


def narrow(model: nn.Module, reference: dict[str, Reference | None], module: str) -> None:
    """Keep only this rank's part of the reference gradients of `module`'s parameters,
    now that it is split: the whole ones are freed module by module while the model is
    split. Why: on meta, the twin's whole reference gradients (a block's worth) alive
    while its LM head was split were the build's peak (64.5 MiB a rank under
    fsdp=2,tp=2 against a target of 57.4)."""
    for name, param in model.get_submodule(module).named_parameters(prefix=module):
        want = reference.get(name)
        if want is not None and not want.local and isinstance(param, DTensor):
            part = local_part(param, want.gradient).clone()  # a view would keep the whole
            reference[name] = dataclasses.replace(want, gradient=part, local=True)


def _largest_difference(have: torch.Tensor, want: Reference) -> float:
    """max |have - want| over this rank's elements: a split `have`'s local part against
    the same elements of the reference, with no gather (on meta, the twin's gathered
    gradients were the build's peak: 64.8 MiB a rank under fsdp=2,tp=2 against a target
    of 57.4). Each rank checks its own part; the problems are gathered after."""
    expected = want.gradient
    if isinstance(have, DTensor):
        if not want.local:
            expected = local_part(have, expected)
        have = have.to_local()
    return _largest_magnitude(have - expected)


def _check_gradients(
    model: nn.Module,
    mesh: DeviceMesh,
    derivation: _Derivation,
    reference: dict[str, Reference | None],
) -> None:
    """The backward check beside the forward one: on the traced input, the split model's
    gradients (whole parameters on every rank, split ones gathered) must be one process's.
    It catches what the plan's rules miss, such as a parameter whose gradient is only this
    rank's part (the forward is right, the ranks' copies drift apart as they train)."""
    got = _gradients(model, derivation.inputs, list(reference))
    # A gradient that is zero in exact arithmetic (a key bias: softmax ignores it) holds
    # rounding noise only, which the split sums in another order: each gradient is
    # measured against at least a thousandth of the largest one.
    largest = max((want.largest for want in reference.values() if want is not None), default=0)
    problem = ""
    for name, want in reference.items():
        have = got.get(name)
        if (want is None) != (have is None):
            problem = f"{name} gets a gradient in {'one' if have is None else 'neither'} run"
        elif want is not None and have is not None:
            rtol = {torch.float64: 1e-6, torch.float32: 1e-3}.get(want.gradient.dtype, 5e-2)
            scale = max(want.largest, 1e-3 * largest)
            if have.shape != want.shape:
                problem = (
                    f"{name}'s gradient has shape {tuple(have.shape)}, not {tuple(want.shape)}"
                )
            elif (off := _largest_difference(have, want)) > rtol * scale:
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


def _plan_summary(plan: dict[str, str]) -> str:
    leaves: dict[str, str] = {}
    for name, style in plan.items():
        leaves.setdefault(name.rsplit(".", 1)[-1], style)
    return ", ".join(f"{leaf}: {style}" for leaf, style in leaves.items())


def _split_of(style: object) -> Split | None:
    """The Split a plan entry names, given as text or as torch's ParallelStyle (None: a
    style of some other kind, which the checks leave alone)."""
    if isinstance(style, str):
        return Split.parse(style)
    if isinstance(style, _LocalShard):
        return Split(style.style, style.chunks)
    if isinstance(style, ColwiseParallel):
        return Split("colwise")
    if isinstance(style, RowwiseParallel):
        return Split("rowwise")
    return None
