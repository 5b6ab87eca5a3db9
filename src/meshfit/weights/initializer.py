"""How to give a model built on meta its initial values, worked out before the forms
change it (materialize.py has the whole story): the calls in order, the tensors each
call writes (found by one pass on full-size scratch tensors) and the random-number
state before each call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshfit.errors import MeshfitError
from meshfit.weights.calls import (
    Call,
    InitFn,
    Slot,
    _key,
    _own_slots,
    _post_order,
    _reset,
    _table,
)


def on_meta(model: nn.Module) -> bool:
    """Whether `model` is built on meta (every parameter and buffer); a model with some
    tensors on meta and others not is refused, naming one of each."""
    meta, real = None, None
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            meta = meta or name
        else:
            real = real or name
    if meta and real:
        raise MeshfitError(
            f"{type(model).__name__} is partly on the meta device ({meta}) and partly not "
            f"({real}); build all of it under `with torch.device('meta')`, or none of it"
        )
    return meta is not None


@dataclass
class Initializer:
    """How to give a model built on meta its initial values, worked out before the forms
    change it: the calls in order, the slots each one writes, and the slots that hold
    each tensor (the first holder's values win)."""

    names: dict[int, str]  # {id of a module: its qualified name}
    calls: list[Call]
    writes: list[list[Slot]]  # per call, the slots it writes
    shapes: dict[tuple[int, str], tuple[torch.Size, torch.dtype, bool]] = field(
        default_factory=dict
    )  # {(id of module, name): (shape, dtype, requires_grad)} of every slot
    groups: list[list[Slot]] = field(default_factory=list)  # the holders of each tensor
    # The random-number state before each call, as the pass that found the writes saw
    # them from the state `starts_from`; None where that pass cannot stand for the real
    # one (a call writes another module's tensor, which that pass left on meta, undrawn).
    starts: list[torch.Tensor] | None = None
    starts_from: torch.Tensor | None = None
    starts_to: torch.Tensor | None = None  # the state after the last call

    def name_of(self, slot: Slot) -> str:
        module, _, name = slot
        where = self.names.get(id(module), "")
        return f"{where}.{name}" if where else name


def plan_initialization(model: nn.Module, init: InitFn | Sequence[InitFn] | None) -> Initializer:
    """The Initializer of `model` (on meta), before any form changes it. `init`: the
    functions of the passes after reset_parameters (default: a Hugging Face model's own
    initialisation, in the order its constructors run it)."""
    from meshfit.weights.hf_init import hugging_face_calls, is_hugging_face

    if init is None and is_hugging_face(model):
        calls = hugging_face_calls(model)
    else:
        fns = [] if init is None else [init] if callable(init) else list(init)
        for fn in fns:
            if not callable(fn):
                raise MeshfitError(
                    f"init must be a function of a module (or a list of them), not {fn!r}"
                )
        order = _post_order(model)
        calls = [("reset_parameters", _reset, m) for m in order]
        calls += [(getattr(fn, "__name__", "init"), fn, m) for fn in fns for m in order]
    initializer = _tensors_of(model, calls)
    initializer.writes = _find_writes(model, initializer)
    return initializer


def _tensors_of(model: nn.Module, calls: list[Call]) -> Initializer:
    """An Initializer of `calls` with every tensor of `model`: its holders (the first
    by registration order first), shape and dtype."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    groups: dict[int, list[Slot]] = {}
    shapes = {}
    for module in _post_order(model):
        for slot, tensor in _own_slots(module):
            groups.setdefault(id(tensor), []).append(slot)
            shapes[id(module), slot[2]] = (tensor.shape, tensor.dtype, tensor.requires_grad)
    order = {id(m): i for i, m in enumerate(model.modules())}  # registration order
    for holders in groups.values():  # the first holder first
        holders.sort(key=lambda slot: order[id(slot[0])])
    return Initializer(names, calls, [], shapes, list(groups.values()))


def _record_random_states(initializer: Initializer) -> list[torch.Tensor]:
    """Make every call on scratch tensors, recording the random-number state before each:
    the real run then replays the calls that write a tensor, alone. Only where the pass
    of `_find_writes` could not record them: a pass of draws over the whole model, a
    third of a 159M Llama's build time on meta (measured: BENCHMARKS.md)."""
    starts = []
    for (_, fn, module), slots in zip(initializer.calls, initializer.writes, strict=True):
        starts.append(torch.get_rng_state())
        with _swapped(initializer, slots, {}):
            fn(module)
    return starts


def _find_writes(model: nn.Module, initializer: Initializer) -> list[list[Slot]]:
    """Which slots each call writes: its module's own, and any other it writes (found on
    meta, each slot meanwhile holding a meta tensor of its own, so a write names it)."""
    every = [slot for module in _post_order(model) for slot, _ in _own_slots(module)]
    saved = {_key(slot): _table(slot[0], slot[1])[slot[2]] for slot in every}
    stand_ins = {}
    for slot in every:
        module, kind, name = slot
        original = saved[_key(slot)]
        tensor = torch.empty_like(original, device="meta")
        if kind == "param":
            tensor = nn.Parameter(tensor, requires_grad=original.requires_grad)
        _table(module, kind)[name] = tensor
        stand_ins[tensor.untyped_storage()._cdata] = slot
    writes, starts = [], []
    random_state = torch.get_rng_state()  # the calls below must not draw for the real run
    try:
        for _, fn, module in initializer.calls:
            own = [slot for slot, _ in _own_slots(module)]
            spy = _Writes(stand_ins)
            starts.append(torch.get_rng_state())
            with _swapped(initializer, own, {}), spy, torch.no_grad():
                fn(module)
            writes.append(own + [s for s in spy.slots if s not in own])
        ends = torch.get_rng_state()
    finally:
        for slot in every:
            _table(slot[0], slot[1])[slot[2]] = saved[_key(slot)]
        torch.set_rng_state(random_state)
    # The calls drew here as they will for real if each wrote only its own tensors (those
    # were full-size here, as they will be then); a write to another module's tensor was
    # made on meta, drawing nothing: then the real run records its own states.
    if all(
        len(w) == len(_own_slots(m)) for w, (_, _, m) in zip(writes, initializer.calls, strict=True)
    ):
        initializer.starts, initializer.starts_from = starts, random_state
        initializer.starts_to = ends
    return writes


class _Writes(TorchDispatchMode):
    """Records the slots whose meta stand-ins an operation writes (in place)."""

    def __init__(self, stand_ins: dict[int, Slot]) -> None:
        super().__init__()
        self.stand_ins = stand_ins
        self.slots: list[Slot] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for arg, spec in zip(args, schema.arguments, strict=False):
                if isinstance(arg, torch.Tensor) and spec.alias_info and spec.alias_info.is_write:
                    if arg.is_meta:
                        slot = self.stand_ins.get(arg.untyped_storage()._cdata)
                        if slot is not None and slot not in self.slots:
                            self.slots.append(slot)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _swapped(
    initializer: Initializer,
    slots: list[Slot],
    scratch: dict[tuple[int, str], torch.Tensor],
    bool_start: bool = False,
) -> Iterator[None]:
    """The `slots` hold full-size CPU tensors meanwhile: those in `scratch` (carried
    from call to call), else new ones filled with a value no initialisation writes (NaN;
    the smallest integer; for a bool, `bool_start`), so one left unwritten shows."""
    saved = []
    for slot in slots:
        module, kind, name = slot
        key = _key(slot)
        if key not in scratch:
            shape, dtype, _ = initializer.shapes[key]
            value = torch.empty(tuple(shape), dtype=dtype)
            if dtype == torch.bool:
                value.fill_(bool_start)
            else:
                value.fill_(float("nan") if value.is_floating_point() else _unwritten_int(dtype))
            scratch[key] = value
        # where the name is now: a pipeline stage holds a weight another stage trains as
        # a stand-in buffer (pipeline/cut.py)
        table = module._parameters if name in module._parameters else module._buffers
        saved.append((table, name, table[name]))
        value = scratch[key]
        requires_grad = initializer.shapes[key][2]
        as_param = table is module._parameters
        table[name] = nn.Parameter(value, requires_grad=requires_grad) if as_param else value
    try:
        with torch.no_grad():
            yield
    finally:
        for table, name, tensor in saved:
            table[name] = tensor


def _unwritten_int(dtype: torch.dtype) -> int:
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _unwritten(value: torch.Tensor) -> bool:
    """Whether `value` still holds the mark an unwritten tensor starts with (NaN, or its
    integer type's smallest value), checked a million elements at a time: a whole
    tensor's test made a temporary of a byte per element beside it (4 MiB of the one
    process's meta build peak on a 16 MiB embedding, BENCHMARKS.md)."""
    if value.dtype == torch.bool:
        return False  # compared between two starts instead (materialize)
    flat = value.reshape(-1)
    for chunk in flat.split(1 << 20):
        if value.is_floating_point():
            found = chunk.isnan().any()
        else:
            found = (chunk == _unwritten_int(value.dtype)).any()
        if bool(found):
            return True
    return False
