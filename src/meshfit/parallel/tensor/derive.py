"""The plan from the trace: Megatron's column/row pairs per block (_classify), the fused
projections' chunks, the experts' weight parameters, the integer sizes each rank must
see as its local value, and the replicated parameters whose gradients are summed over
the tp ranks."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import KERAS_LAYERS, find_blocks, keras_model
from meshfit.parallel.tensor.derivation import _Derivation
from meshfit.parallel.tensor.split import (
    ELEMENTWISE,
    HEAD_ATTRS,
    KV_HEAD_ATTRS,
    Split,
    _dims,
    _is_channel_layer,
    _is_conv,
    _is_projection,
)
from meshfit.parallel.tensor.trace import (
    TABLE,
    _block_units,
    _BlockTrace,
    _Call,
    _own_weights,
    _trace_blocks,
)
from meshfit.parallel.tensor.trial import keep_whole_what_cannot_split


def derive_tp_plan(model: nn.Module, example_inputs: Any = None) -> dict[str, str]:
    """{qualified projection name: "colwise" | "colwise:N" | "rowwise"} for `model`,
    found by running it once (see the module doc); "colwise:N" is a fused projection
    whose output is cut into N equal chunks (q|k|v) that are split one by one."""
    return _derive(model, example_inputs).plan


def _derive(
    model: nn.Module, example_inputs: Any = None, tp: int | None = None, experts_whole: bool = False
) -> _Derivation:
    """The plan (a Sequential's pairs, else from one traced forward), with what the split
    model is checked against. With `tp` known, key/value heads fewer than the tp ranks
    are replicated (_replicate_shared_kv); `experts_whole`: nothing of an experts module."""
    if type(model) is nn.Sequential:
        plan = _sequential_pairs(model, prefix="")
        if plan:
            return _Derivation(plan)
    try:
        stack = find_blocks(model)
    except MeshfitError:
        if keras_model(model):
            raise MeshfitError(
                f"tensor parallel finds nothing to split in {type(model).__name__}: "
                f"{KERAS_LAYERS}; train it with dp or fsdp, which take it as it is"
            ) from None
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
            model,
            f"its blocks hold no matrix-product layer (Linear, convolution), only "
            f"{', '.join(kinds)}",
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
        shared = _shared_kv_projections(trace, modules, tp) if tp and tp > 1 else {}
        trace.across_width -= set(shared)  # kept whole: a norm over its width is fine
        try:
            block_plan = _classify(trace, whole)
        except _Unsettled as unsettled:
            raise MeshfitError(
                f"tensor parallel's derivation does not settle on block {name!r} of "
                f"{type(model).__name__} (it keeps re-deciding {', '.join(unsettled.names[:3])}): "
                f"a meshfit bug, please report it; train this model with dp, fsdp or pp, "
                f"or give tp_plan= yourself"
            ) from None
        block_plan.update(_channel_layers(trace, block_plan, modules))
        replicated = _replicate_shared_kv(trace, block_plan, modules, shared, whole, tp or 1)
        kept = [n for n in shared if f"{n}.weight" in replicated]
        split.summed_inputs += kept
        split.kv_slices.update(
            {n: (shared[n], _dims(modules[n])[1] // shared[n]) for n in kept if shared[n] > 1}
        )
        plan.update(block_plan)
        split.summed += _partial_gradients(trace, block_plan) + replicated
        local_attrs.update(_stored_sizes(modules, block_plan))
        for owner in {n.rsplit(".", 1)[0] for n in kept}:
            groups = getattr(modules.get(owner), "num_key_value_groups", None)
            heads = max(shared[n] for n in kept if n.rsplit(".", 1)[0] == owner)
            if type(groups) is int:
                # q heads per k/v head: each rank's H/tp q heads read one k/v head, so
                # the value divided by tp (_settle_local_sizes) is the q head count H
                local_attrs.setdefault(owner, {})["num_key_value_groups"] = groups * heads
        _note_weights(split, trace, block_plan, whole, prefix=f"{name}.")
    split.inputs, split.local_attrs = inputs, local_attrs
    keep_whole_what_cannot_split(model, split, tp if tp and tp > 1 else 2, experts_whole)
    if "rowwise" not in plan.values():
        kept = "".join(f"; {owner} kept whole: {why}" for owner, why in split.whole.items())
        raise _nothing_to_split(
            model,
            f"no matrix product in its blocks ({stack.name or 'the model'!r}) reads the block's "
            f"input and feeds, through per-element or per-head steps only, one that writes back "
            f"to the block's output{kept}",
        )
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


def _main_inputs(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """For a Hugging Face model whose main input is not token ids, a tiny batch of it,
    shaped by its config: `pixel_values` (vision: num_channels x image_size^2) or
    `input_features` (speech: num_mel_bins x 2 max_source_positions frames), with
    `decoder_input_ids` for an encoder-decoder. Its `dummy_inputs` are token ids for
    every model (transformers 5), which a ViT, ConvNeXt or Whisper does not take. None
    where the config does not say the shape."""
    name = getattr(model, "main_input_name", "input_ids")
    config = getattr(model, "config", None)
    if name == "input_ids" or config is None:
        return None
    g = torch.Generator().manual_seed(0)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if name == "pixel_values":
        size = getattr(config, "image_size", None)
        channels = getattr(config, "num_channels", None)
        if isinstance(size, int):
            size = (size, size)
        if not (isinstance(size, (tuple, list)) and len(size) == 2 and isinstance(channels, int)):
            return None
        shape = (2, channels, *size)
    elif name == "input_features":
        bins = getattr(config, "num_mel_bins", None)
        frames = getattr(config, "max_source_positions", None)
        if not (isinstance(bins, int) and isinstance(frames, int)):
            return None
        shape = (2, bins, 2 * frames)
    else:
        return None
    inputs = {name: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)}
    if getattr(config, "is_encoder_decoder", False):
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int):
            return None
        inputs["decoder_input_ids"] = torch.randint(0, vocab, (2, 4), generator=g)
    return inputs


def _image_size(model: nn.Module) -> tuple[int, int] | None:
    """The (height, width) a module of `model` keeps as `img_size` or `image_size`."""
    for module in model.modules():
        for attr in ("img_size", "image_size"):
            size = getattr(module, attr, None)
            if isinstance(size, int) and size > 0:
                return size, size
            if isinstance(size, (tuple, list)) and len(size) == 2:
                if all(isinstance(n, int) and n > 0 for n in size):
                    return size[0], size[1]
    return None


def _dummy_inputs(model: nn.Module) -> Any:
    """A tiny input to trace `model` on: a Hugging Face model's main input shaped by its
    config (_main_inputs), else its own `dummy_inputs`, else token ids for a model whose
    first layer is an Embedding, images for a first Conv2d (of the size a module keeps
    as `img_size` / `image_size`, as timm's patch embedding does; else 64 x 64), else
    features for a first Linear. A wrong guess fails the trace, which then asks for
    example_inputs."""
    dummy = _main_inputs(model)
    if dummy is None:
        dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, Mapping) and dummy:
        device = next(model.parameters()).device
        return {k: v.to(device) for k, v in dummy.items()}
    kinds = (nn.Embedding, nn.Linear, nn.Conv2d)
    first = next((m for m in model.modules() if isinstance(m, kinds)), None)
    if first is None:
        raise _nothing_to_split(model, "meshfit cannot make an input to trace it with")
    g = torch.Generator().manual_seed(0)
    device = first.weight.device
    if isinstance(first, nn.Embedding):
        return torch.randint(0, first.num_embeddings, (2, 4), generator=g).to(device)
    if isinstance(first, nn.Conv2d):
        shape = (2, first.in_channels, *(_image_size(model) or (64, 64)))
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        return x.to(device=device, dtype=first.weight.dtype)
    x = torch.randn(2, first.in_features, generator=g, dtype=torch.float64)
    return x.to(device=device, dtype=first.weight.dtype)


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class _Unsettled(Exception):
    """_classify's rounds did not settle (the names it kept re-deciding)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.names = names


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
    # why a projection was first demoted: said when the block splits nothing
    first_why = {
        n: f"{_leaf(n)}'s output is normalised or reduced over its whole width"
        for n in sorted(trace.across_width)
    }
    for _ in range(len(trace.calls) + 2):  # each round demotes a call: bounded
        state: dict[str, str] = {}
        bad: set[str] = set()
        for call in trace.calls:
            if call.name in state:  # called twice in one block: leave it whole
                if state[call.name] == "col":
                    bad.add(call.name)
                bad |= {s for s in call.sources if state.get(s) == "col"}
                state[call.name] = "whole"
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
                for s in sharded - set(first_why):
                    others = sorted(
                        "the block's input" if r == "H" else f"{_leaf(r)}'s output"
                        for r in replicated
                    )
                    first_why[s] = (
                        f"{_leaf(s)}'s split output meets {' and '.join(others) or 'an output'}"
                        f" (whole on every rank) in {_leaf(call.name)}, which no column/row "
                        f"pair allows"
                    )
        bad |= {s for s in trace.reaches_output if state.get(s) == "col"}
        read_by_row = {s for c in trace.calls if state.get(c.name) == "row" for s in c.sources}
        bad |= {n for n, s in state.items() if s == "col" and n not in read_by_row}
        bad |= _owner_problems(trace, state, whole)
        if not bad:
            break
        if bad <= demoted:  # the same round again: it would never settle
            raise _Unsettled(sorted(bad))
        demoted |= bad
    else:
        raise _Unsettled(sorted(demoted))
    for name, why in trace.misused.items():  # a module without a reason of its own above
        whole.setdefault(name.rsplit(".", 1)[0], f"{name.rsplit('.', 1)[-1]}: {why}")
    if first_why and "row" not in state.values():  # nothing split: say where pairing broke
        name, why = next(iter(first_why.items()))
        owner = name.rsplit(".", 1)[0]
        whole[owner] = f"{whole[owner]}; {why}" if owner in whole else why
    plan: dict[str, str] = {n: "colwise" for n, s in state.items() if s == "table"}
    for call in trace.calls:
        if state.get(call.name) == "col":
            plan[call.name] = str(Split("colwise", call.chunks))
        elif state.get(call.name) == "row":
            plan[call.name] = "rowwise"
    return plan


def _channel_layers(
    trace: _BlockTrace, plan: dict[str, str], modules: dict[str, nn.Module]
) -> dict[str, str]:
    """{per-channel layer (BatchNorm): "colwise"} for those whose input is the output of
    column-parallel projections only, as wide as they are (ResNet's bn1 between conv1
    and conv2): each rank holds some channels, so the layer is split by channel with
    them (styles._ChannelShard)."""
    found = {}
    for name, labels in trace.channel_layers.items():
        width = getattr(modules.get(name), "num_features", None)
        if labels and all(
            plan.get(label) == "colwise"
            and _is_projection(modules[label])
            and _dims(modules[label])[1] == width
            for label in labels
        ):
            found[name] = "colwise"
    return found


def _shared_kv_projections(
    trace: _BlockTrace, modules: dict[str, nn.Module], tp: int
) -> dict[str, int]:
    """{k/v projection: its head count} for attention whose key/value heads are fewer
    than the `tp` ranks (multi-query attention: Falcon, Gemma-2B; grouped-query with 2
    k/v heads under tp=4): the block's projections some heads wide (`head_dim` of the
    module holding them) beside a wider one whose heads the ranks share out. With one
    k/v head, any tp; with several, tp must be a multiple of their count (each rank's q
    heads then read one k/v head)."""
    by_owner: dict[str, list[str]] = {}
    for call in trace.calls:
        module = modules.get(call.name)
        if call.chunks == 1 and module is not None and _is_projection(module):
            by_owner.setdefault(call.name.rsplit(".", 1)[0], []).append(call.name)
    found: dict[str, int] = {}
    for owner, names in by_owner.items():
        head_dim = getattr(modules.get(owner), "head_dim", None)
        if type(head_dim) is not int or head_dim <= 0:
            continue
        widths = {n: _dims(modules[n])[1] for n in names}
        widest = max(widths.values())
        for name, width in widths.items():
            heads, rest = divmod(width, head_dim)
            if rest or width >= widest or heads >= tp:
                continue
            if heads == 1 and head_dim * tp <= widest:  # q has a head for every rank
                found[name] = 1
            elif heads > 1 and tp % heads == 0 and widest % (head_dim * tp) == 0:
                found[name] = heads
    return found


def _replicate_shared_kv(
    trace: _BlockTrace,
    plan: dict[str, str],
    modules: dict[str, nn.Module],
    shared: dict[str, int],
    whole: dict[str, str],
    tp: int,
) -> list[str]:
    """Key/value heads fewer than the tp ranks stay whole on every tp rank, as Megatron
    and transformers keep them, while q and o are split: `shared`'s projections leave
    `plan`. Megatron keeps on each rank only the k/v head its q heads read; here each
    rank runs the whole (small) projection and keeps that head of its output
    (_Derivation.kv_slices), so the weights stay one tensor in the checkpoint. Each
    rank's q heads then read their k/v head, so the gradients of those projections, and
    of every parameter on their path (a k_norm), are each rank's part: returned, to be
    summed over the tp ranks."""
    kept = [n for n in shared if n in plan]
    summed: list[str] = []
    for name in kept:
        del plan[name]
        heads = shared[name]
        whole[name] = (
            "one key/value head, on every tp rank"
            if heads == 1
            else f"{heads} key/value heads for tp={tp}, on every tp rank (each uses the "
            f"one its query heads read)"
        )
        summed += [f"{name}.{p}" for p, _ in modules[name].named_parameters(recurse=False)]
    summed += [
        param
        for param, partners in trace.partners.items()
        if partners & set(kept) and param.rsplit(".", 1)[0] not in plan and param not in summed
    ]
    return summed


def _partial_gradients(trace: _BlockTrace, plan: dict[str, str]) -> list[str]:
    """The parameters that `plan` leaves whole but that act on column-parallel values
    (per-head norms applied to each rank's own heads): each rank's gradient is the part
    of its heads, so the parts must be summed over the tp ranks (Megatron does the same
    for its q/k layer norms). The column-parallel values are the split projections'
    outputs and split position tables'."""
    sharded = {n for n, style in plan.items() if Split.parse(style).column}
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
        split = Split.parse(style)
        if name in modules and split.column and _is_projection(modules[name]):
            widths.add(_dims(modules[name])[1] // split.chunks)
    owners = {name.rsplit(".", 1)[0] for name in plan if "." in name}
    found: dict[str, dict[str, int]] = {}
    for owner in owners:
        module = modules.get(owner)
        if module is None:
            continue
        read = _attributes_read(type(module)) | _attributes_read_by_helpers(module)
        attrs = {}
        for attr in read:
            value = getattr(module, attr, None)
            if type(value) is not int or attr.endswith(("head_dim", "head_size")):
                continue
            # a head count under any name (diffusers' `heads`), or a split width; a
            # wrong guess is caught: _settle_local_sizes keeps only what reproduces the
            # unsplit output
            head_count = "head" in attr.lower() and value > 1
            if attr in HEAD_ATTRS or attr in KV_HEAD_ATTRS or head_count or value in widths:
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
    return _reads_of(source, "self")


def _reads_of(source: str, holder: str) -> set[str]:
    """The attributes `source` reads as `<holder>.<name>` (not method calls)."""
    return set(re.findall(rf"\b{re.escape(holder)}\.([A-Za-z_]\w*)\b(?!\s*\()", source))


def _attributes_read_by_helpers(module: nn.Module) -> set[str]:
    """`<module>.<name>` reads in the `__call__` of a helper object the module keeps and
    hands itself to (diffusers' attention processors: `processor(attn, hidden_states)`
    reads `attn.heads`, which the module's own forward never names)."""
    found: set[str] = set()
    for value in vars(module).values():
        if isinstance(value, (nn.Module, type)) or not callable(value):
            continue
        call = type(value).__call__
        if not inspect.isfunction(call):  # a builtin's: no source to read
            continue
        try:
            params = list(inspect.signature(call).parameters)
            source = inspect.getsource(call)
        except (OSError, TypeError, ValueError):
            continue
        if len(params) < 2:
            continue
        found |= _reads_of(source, params[1])
    return found


def _sequential_pairs(seq: nn.Sequential, prefix: str) -> dict[str, str]:
    """Pair Linears (or convolutions) in a Sequential that only element-wise layers
    separate, and for convolutions per-channel ones too: BatchNorm (split by channel
    with the pair) and pooling (it acts on each channel alone)."""
    plan: dict[str, str] = {}
    pending: str | None = None  # a layer waiting for its row-parallel partner
    between: list[str] = []  # per-channel layers after it, split with it
    for key, child in seq._modules.items():
        held = seq._modules[pending] if pending is not None else None
        if isinstance(child, nn.Linear) or _is_conv(child):
            if held is None or type(held) is not type(child):
                pending, between = key, []
            else:
                plan[prefix + pending] = "colwise"
                plan.update({prefix + k: "colwise" for k in between})
                plan[prefix + key] = "rowwise"
                pending = None
        elif held is not None and _is_channel_layer(child):
            if child.num_features != _dims(held)[1]:
                pending = None
            else:
                between.append(key)
        elif held is not None and _is_conv(held) and isinstance(child, _POOLING):
            continue
        elif not isinstance(child, ELEMENTWISE):
            pending = None
    return plan


# Pooling acts on each channel alone: a column-parallel convolution's output channels
# pass through it to the row-parallel one unchanged.
_POOLING = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
            nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)  # fmt: skip
