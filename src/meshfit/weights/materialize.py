"""Models built on `meta`: the forms split the model as it is (it holds no memory), then
each rank gives storage only to what it keeps and fills it with the values one process
would give the same model.

A model built under ``with torch.device("meta")`` has shapes and no values. meshfit
initialises it as its constructors would have, as a list of calls, each one function on
one module:

- each module's own `reset_parameters()` (what torch's layers run when they are built),
  children before their parent;
- then each function of `init`, on every module after its children, as `Module.apply`
  does; or, for a Hugging Face model, its `_init_weights` as each PreTrainedModel's
  `post_init` applies it (a sub-model initialised where it is built).

A call may write tensors of the module's descendants (GPT-2's and T5's `_init_weights`
set their children's weights): which it writes is found once, before any form, by making
every call with its module's own tensors full-size CPU scratch and every other tensor a
meta stand-in. That pass also records the random-number state before each call; where no
call writes another module's tensors (so the pass drew what the real calls draw), and the
rank's state is still the one the pass started from, the real run uses those states;
otherwise every rank makes every call again (also for what another rank keeps, so the
random numbers are drawn in one order everywhere) on full-size CPU scratch tensors,
recording them. Each rank then materializes what it keeps: for each of its tensors
it replays, from the recorded states, the calls that write it, and keeps its slice (the
whole tensor for a replica, its shard under fsdp or tp, its stage's under pp). The extra memory
is what one module's calls write. The random-number state starts from rank 0's and ends
where the calls leave it, so the values, and the random numbers drawn after them, do not
depend on the plan: a model built on meta trains the same run under every plan as in one
process. They equal a model built on the CPU with the same seed where its constructors
draw in this order (torch's layers and Hugging Face's models do; tested).

Tied tensors (an LM head sharing the token embedding's weight) are initialised apart, as
they are before Hugging Face's `tie_weights`, and take the values of their first holder
(the embedding). A tensor that no call writes (a buffer computed in `__init__`, a
parameter made with `torch.ones` by a module without `reset_parameters`) cannot be
rebuilt: it is refused by name, before training.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshfit.errors import MeshfitError
from meshfit.parallel.placements import local_part
from meshfit.weights.calls import Slot, _current, _key
from meshfit.weights.initializer import (
    Initializer,
    _record_random_states,
    _swapped,
    _unwritten,
)

if TYPE_CHECKING:
    from meshfit.weights.files import WeightFiles


def materialize(
    initializer: Initializer,
    model: nn.Module,
    device: torch.device,
    weights: WeightFiles | None = None,
) -> None:
    """Give `model` (as the forms left it: split, sharded, pruned; still on meta) storage
    on `device` for what this rank keeps, and the values one process would give it:
    from `weights` where they hold the tensor (each rank reads only its slice), else
    from the model's initialisation."""
    if weights is not None:
        weights.check(initializer)
    with returned_to_the_system():
        _materialize(initializer, model, device, weights)


def _materialize(
    initializer: Initializer, model: nn.Module, device: torch.device, weights: WeightFiles | None
) -> None:
    _same_random_state()
    if initializer.starts is not None and torch.equal(
        torch.get_rng_state(), initializer.starts_from
    ):
        # the same calls from the same state: the same draws, and the state they end in
        # (where one process's constructor leaves it)
        starts, after = initializer.starts, initializer.starts_to
    else:
        starts = _record_random_states(initializer)
        after = torch.get_rng_state()
    kept = {id(m) for m in model.modules()}
    stand_ins = _remove_stand_ins(model)
    _untie(initializer, kept)
    model.to_empty(device=device)
    _restore_stand_ins(stand_ins, device)
    _tie_again(initializer, kept)
    writers: dict[tuple[int, str], list[int]] = {}  # {slot key: indices of calls writing it}
    for index, slots in enumerate(initializer.writes):
        for slot in slots:
            writers.setdefault(_key(slot), []).append(index)
    problem = ""
    released = _release(initializer, kept)
    for holders in initializer.groups:
        targets = [
            current
            for module, kind, name in holders
            if id(module) in kept
            and (current := _current(module, name)) is not None
            and not _is_stand_in(current)
        ]
        if not targets:
            continue
        distinct = list({id(t): t for t in targets}.values())  # a tie kept as one object
        first = holders[0]
        stored = weights.name_in_file(initializer, holders) if weights is not None else None
        if stored is not None:
            for current in distinct:
                _regrow(current, released)
                weights.read_into(stored, current)
            continue
        value = _replayed(initializer, writers.get(_key(first), []), starts, first)
        if initializer.shapes[_key(first)][1] == torch.bool:
            # no bool value marks one unwritten: replay from True too, and compare
            again = _replayed(initializer, writers.get(_key(first), []), starts, first, True)
            if value is not None and not torch.equal(value, again):
                value = None
        if value is None or _unwritten(value):
            problem = problem or _unwritten_line(initializer, first)
            continue
        for current in distinct:
            if len(distinct) == 1 and _adopt(current, value, released):
                continue  # the value's storage is the tensor's now: no copy
            _regrow(current, released)
            _fill(current, value)
        del value  # before the next group's scratch: one module's tensors at a time
    for current in list(released.values()):  # never filled (refused below): whole again
        _regrow(current, released)
    torch.set_rng_state(after)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover and not problem:
        problem = f"meshfit could not give {leftover[0]} storage on {device}"
    problem = _on_every_rank(problem)
    if problem:
        raise MeshfitError(problem)


# glibc's mmap threshold (mallopt's M_MMAP_THRESHOLD) and its largest dynamic value on a
# 64-bit system: 4 * 1024 * 1024 * sizeof(long).
_M_MMAP_THRESHOLD, _SMALL, _DYNAMIC_MAX = -3, 1 << 20, 32 << 20


@contextlib.contextmanager
def returned_to_the_system() -> Iterator[None]:
    """While a model is materialized, CPU blocks of 1 MB or more are mapped on their own,
    so freeing one gives its memory back to the system. By default glibc raises its mmap
    threshold to the largest block freed so far (up to 32 MB), after which the replay's
    full-size scratch tensors come from the heap, between the shards that are kept, and
    stay resident once freed: measured on 4 CPU workers building a 582 MiB Llama on meta
    under fsdp=4 (tests/test_capped.py's model), each process's resident memory peaked at
    880 MiB while it built its 146 MiB shard, and at 152 MiB with this. Afterwards the
    threshold is the user's MALLOC_MMAP_THRESHOLD_ where set, else glibc's dynamic
    ceiling, which is where training brings the dynamic one anyway. A no-op off glibc.
    The forms' build enters it for the whole of parallelize (parallel/compose.py), which
    holds the materialization's own entry; only the outermost sets and restores it
    (BENCHMARKS.md, "Resident memory over the whole build")."""
    libc = _glibc()
    if libc is None or _LOWERED[0]:  # not glibc, or an enclosing build lowered it already
        yield
        return
    given = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    after = int(given) if given.isdigit() else _DYNAMIC_MAX
    libc.mallopt(_M_MMAP_THRESHOLD, min(_SMALL, after))
    _LOWERED[0] = True
    try:
        yield
    finally:
        _LOWERED[0] = False
        libc.mallopt(_M_MMAP_THRESHOLD, after)


_LOWERED = [False]  # whether returned_to_the_system is in force (the outermost sets it)


def _glibc() -> Any:
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _on_every_rank(problem: str) -> str:
    """The first rank's problem on every rank (a rank that keeps the unwritten tensor
    finds it; the others must refuse too, not wait for it in a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), "")


def _replayed(
    initializer: Initializer,
    calls: list[int],
    starts: list[torch.Tensor],
    slot: Slot,
    bool_start: bool = False,
) -> torch.Tensor | None:
    """The full value `slot` ends with: its writing `calls` made again, in order, each
    from its recorded random-number state, on scratch tensors carried between them."""
    scratch: dict[tuple[int, str], torch.Tensor] = {}
    for index in calls:
        torch.set_rng_state(starts[index])
        _, fn, module = initializer.calls[index]
        with _swapped(initializer, initializer.writes[index], scratch, bool_start):
            fn(module)
    return scratch.get(_key(slot))


def _tied(initializer: Initializer, kept: set[int]) -> list[list[tuple[nn.Module, str]]]:
    """Per parameter that several kept modules hold (a tied LM head): its holders."""
    found = []
    for holders in initializer.groups:
        held = [
            (module, name)
            for module, kind, name in holders
            if kind == "param" and id(module) in kept and name in module._parameters
        ]
        if len(held) > 1:
            found.append(held)
    return found


def _untie(initializer: Initializer, kept: set[int]) -> None:
    """Take a tied parameter out of every holder but the first while the model gets
    storage: to_empty visits each module's own table, so each holder would be given a
    full-size tensor of its own (measured on an H200: a 1.24B Llama's 1 GiB embedding
    twice on the GPU), of which _tie_again keeps one."""
    for held in _tied(initializer, kept):
        for module, name in held[1:]:
            module._parameters[name] = None


def _tie_again(initializer: Initializer, kept: set[int]) -> None:
    """A parameter several modules hold (a tied LM head) is one object again (to_empty
    would give each module a new Parameter of its own: from meta, torch cannot swap the
    data in place, and tied copies would train apart)."""
    for held in _tied(initializer, kept):
        first = held[0][0]._parameters[held[0][1]]
        for module, name in held[1:]:
            module._parameters[name] = first


def _same_random_state() -> None:
    """Every rank starts the calls from rank 0's random-number state."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    box = [torch.get_rng_state()]
    dist.broadcast_object_list(box, src=0)
    torch.set_rng_state(box[0])


def _unwritten_line(initializer: Initializer, slot: Slot) -> str:
    module = slot[0]
    done = ", ".join(dict.fromkeys(what for what, _, m in initializer.calls if m is module))
    return (
        f"{initializer.name_of(slot)} of a model built on meta gets no value from its "
        f"initialisation ({done or 'nothing is called on its module'}): it is set when the "
        f"model is built (a buffer computed in __init__, a parameter made with torch.ones), "
        f"which on meta did not happen; pass init=fn(module) that sets it, or build the "
        f"model on the CPU"
    )


def _release(initializer: Initializer, kept: set[int]) -> dict[int, torch.Tensor]:
    """Give back the storage to_empty just gave each whole (not sharded) tensor that a
    value will fill, keeping its shape: {id: tensor}. Each gets its storage when its value
    is made (_adopt: the value's own; _regrow: its own again), so no tensor's empty
    storage and its full value are alive together. Why: a whole tensor and its value
    both alive cost its size twice; the tp twin (meta.py), all whole, peaked at the twin
    plus its largest tensor's value (64.3 MiB a rank under fsdp=2,tp=2 against a target
    of 57.4), and one process on meta at the model plus its largest tensor."""
    released: dict[int, torch.Tensor] = {}
    for holders in initializer.groups:
        for module, _, name in holders:
            current = _current(module, name) if id(module) in kept else None
            if (
                current is not None
                and not isinstance(current, DTensor)
                and not _is_stand_in(current)
                and current.numel()
                and current.untyped_storage().nbytes()
            ):
                released[id(current)] = current
    for current in released.values():
        current.untyped_storage().resize_(0)
    return released


def _adopt(current: torch.Tensor, value: torch.Tensor, released: dict[int, torch.Tensor]) -> bool:
    """Make a released `current` hold `value` by taking its storage (moved to
    current's device first), when `value` is a whole tensor of the same layout that
    nothing else holds (the replay's scratch); False where it cannot."""
    if id(current) not in released or isinstance(value, DTensor):
        return False
    if value.dtype != current.dtype or value.shape != current.shape:
        return False
    if value.stride() != current.stride():
        return False  # checked before any transfer: a refused value moves once, in _fill
    if value.device != current.device:
        value = value.to(current.device)  # a fresh tensor of the same strides: whole
    elif value.storage_offset() or value.untyped_storage().nbytes() != (
        value.numel() * value.element_size()
    ):
        return False  # a view of a larger tensor
    with torch.no_grad():
        current.set_(value)
    del released[id(current)]
    return True


def _regrow(current: torch.Tensor, released: dict[int, torch.Tensor]) -> None:
    """Give a released `current` storage of its own again (to be written in place)."""
    if released.pop(id(current), None) is not None:
        span = current.storage_offset() + sum(
            (n - 1) * st for n, st in zip(current.shape, current.stride(), strict=True)
        )
        current.untyped_storage().resize_((span + 1) * current.element_size())


def _fill(current: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's part of the full `value` into `current` (a DTensor's local
    shard: a view of `value` at the shard's offsets, copied in place; no communication
    and no second copy)."""
    with torch.no_grad():
        current_local = current
        if isinstance(current, DTensor):
            value = local_part(current, value)  # placements.py
            current_local = current.to_local()
        current_local.copy_(value)


def _is_stand_in(tensor: torch.Tensor) -> bool:
    """A pipeline stage's stand-in for a weight another stage trains (pipeline/cut.py):
    one zero broadcast to the weight's shape."""
    return tensor.dim() > 0 and tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


def _remove_stand_ins(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The stand-ins, taken out while the model gets storage (an expanded tensor would
    get full-size storage)."""
    found = []
    for module in model.modules():
        for name, tensor in list(module._buffers.items()):
            if tensor is not None and _is_stand_in(tensor):
                found.append((module, name, tensor))
                del module._buffers[name]
    return found


def _restore_stand_ins(
    found: list[tuple[nn.Module, str, torch.Tensor]], device: torch.device
) -> None:
    for module, name, tensor in found:
        zero = torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)
        module.register_buffer(name, zero, persistent=False)
