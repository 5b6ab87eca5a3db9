"""The peak of live tensor bytes on this rank during one call (a training step), split
into parameters, gradients, optimizer state and the rest, at the moment of the peak.

This is the measuring side of the planner: what `mf.estimate` predicts per
rank is checked against `measure_peak(lambda: engine.step(batch), engine=engine)`.

    peak = measure_peak(lambda: engine.step(batch), engine=engine)
    peak.total, peak.parameters, peak.gradients, peak.optimizer, peak.other

Why not torch's own MemTracker (torch.distributed._tools.mem_tracker): it is the same
idea (a TorchDispatchMode that follows storages through weak references), and where it
runs its total agrees with this one (one process, tp=2, fsdp=2: equal, less the batch it
never counts). Measured on meshfit's engine (torch 2.13, CPU, 2026-11-23), it cannot
serve every plan:
  - a plan that calls the model more than once per step raises NotImplementedError
    ("MemTracker does not support memory tracking for multiple iterative calls": a
    root module's second forward is refused): gradient accumulation (microbatches=2 in
    one process), and every pipeline schedule (a stage runs a forward per micro-batch;
    under pp=2 one stage's tracked step failed and the other stage hung);
  - it files a tensor under the phase that made it, not under what it is: at a peak in
    AdamW's step its "Optstate" was 280,656 B against 149,584 B of state (the foreach
    temporaries); at a peak in the backward the gradient being made is "Temp"
    (recomputation: 2,493,952 B of "Gradient" against 2,756,096 B of .grad storage);
    under fsdp=2 its "Parameter" holds the gathered parameters too (2,805,504 B against
    a shard of 1,722,624 B);
  - it counts only operators' outputs, so a buffer made before the step and then only
    written in place is missed (DDP's gradient buckets once built, pipeline receive
    buffers): under dp=2 its peak was 2.27 MB under this one's, which holds the
    buckets (3.4 MB; dp=2's total equals one process with two micro-batches of 4,
    where the first micro-batch's gradients take their place, to 4 bytes).
FSDPMemTracker is a MemTracker with FSDP2 hooks: it inherits the first limit, and needs
the FSDP root module, which a pipeline stage or a DDP plan does not have.

So this module keeps a smaller counter with the same mechanism and other bookkeeping:
  - every storage an operator reads or writes is followed (deduplicated by storage,
    freed through a weak-reference finalizer, `UntypedStorage.resize_` followed since
    FSDP2 frees and refills its unsharded parameters that way);
  - a storage first met as an operator's INPUT, that the counter never saw made, and
    still alive after the call existed before it (DDP buckets, pipeline buffers, the
    batch): it is counted from the start, by replaying the call's allocation log at the
    end; one that dies inside the call was made out of sight (by C++ in a collective)
    and counts from where it was first met;
  - categories are decided by what a storage IS, not by when it was made: a parameter's
    (or its DTensor shard's) storage, a storage that is some parameter's .grad when an
    optimizer steps (or at the end), or a tensor in the optimizer's state. Everything
    else (activations, gathered FSDP2 parameters, communication and temporary buffers)
    is `other`.
On a GPU the total is `torch.cuda.max_memory_allocated` over the call (what the device
really held, allocator rounding included) and `other` is that total less the model
state at the counter's peak.

What it cannot see: bytes a C++ library allocates and frees without a PyTorch operator
(gloo's own scratch buffers), and CPU allocator overhead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from meshfit.engine import Engine

PARAMETERS, GRADIENTS, OPTIMIZER, OTHER = "parameters", "gradients", "optimizer", "other"
# When one storage is two things (a DDP bucket view as .grad is a gradient), the first wins.
_PRECEDENCE = (PARAMETERS, OPTIMIZER, GRADIENTS)


@dataclass(frozen=True)
class PeakMemory:
    """Bytes at the peak of one call on this rank. `total` = parameters + gradients +
    optimizer + other. On CPU all of it is counted live tensor storage; on a GPU `total`
    is the allocator's peak and `counted_total` the counter's own."""

    total: int
    parameters: int  # this rank's parameter storage (its shards under fsdp / tp)
    gradients: int  # storages that are parameters' .grad when the optimizer steps
    optimizer: int  # optimizer state (AdamW: exp_avg, exp_avg_sq, step)
    other: int  # activations, gathered parameters, communication and temporary buffers
    counted_total: int  # the counter's peak (== total on CPU)
    before: int  # bytes alive when the call started (model state, buffers met later)
    phase: str  # where the peak was: "forward", "backward" or "optimizer"
    op: str  # the operator that reached the peak
    device: str
    # The counter's largest total within each phase (a step's peak is often at the start
    # of backward, before any gradient exists; the optimizer's holds every gradient).
    phase_peaks: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_peak(
    step_fn: Callable[[], Any],
    *,
    engine: Engine | None = None,
    modules: Iterable[nn.Module] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
) -> PeakMemory:
    """Run `step_fn()` once and return the peak of live tensor bytes during it.

    `engine` (or `modules` and `optimizers`) names the model state: its parameters,
    buffers, gradients and optimizer state count from the start even when the step
    never touches them, and they are what the categories are. Any optimizer that steps
    during the call is recognised by itself (a global step hook), so `engine` is only
    needed for state the step does not reach. On a GPU the total comes from
    torch.cuda.max_memory_allocated (reset first)."""
    modules = list(modules)
    optimizers = list(optimizers)
    if engine is not None:
        modules.append(engine.parallel_model)
        optimizers.append(engine.optimizer)
    device = _device_of(modules)
    counter = _Counter(device)
    for module in modules:
        counter.note_module(module)
    for optimizer in optimizers:
        counter.note_optimizer(optimizer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with counter:
        step_fn()
    for module in modules:  # gradients still there after the call (no optimizer ran)
        counter.note_grads(module.parameters())
    peak = counter.peak()
    total = peak["total"]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        total = torch.cuda.max_memory_allocated(device)
    state = peak[PARAMETERS] + peak[GRADIENTS] + peak[OPTIMIZER]
    return PeakMemory(
        total=total,
        parameters=peak[PARAMETERS],
        gradients=peak[GRADIENTS],
        optimizer=peak[OPTIMIZER],
        other=total - state,
        counted_total=peak["total"],
        before=peak["before"],
        phase=peak["phase"],
        op=peak["op"],
        device=str(device),
        phase_peaks=peak["phase_peaks"],
    )


def _device_of(modules: list[nn.Module]) -> torch.device:
    for module in modules:
        for p in module.parameters():
            return _local(p).device
    return torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real storages behind `t`: a DTensor's local shard's, a wrapper subclass's
    inner tensors'; none for meta or fake tensors (no bytes behind them)."""
    t = _local(t)
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None:
            names, _ = flatten()
            return [s for name in names for s in _storages(getattr(t, name))]
    if t.device.type == "meta" or "Fake" in type(t).__name__:
        return []
    st = t.untyped_storage()
    return [] if st.device.type == "meta" else [st]


class _Counter(TorchDispatchMode):
    """The allocation log of one call: each storage gets a key; events are (key, bytes
    added) in order; `before` holds the keys alive from the start. Categories are tags
    by key, given whenever the counter learns what a storage is."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        # Only this device's bytes: on a GPU, a batch or an offloaded state on the CPU
        # is not the device's memory.
        self.device = device
        self._keys: dict[int, int] = {}  # id(storage) -> key, while the storage lives
        self._sizes: dict[int, int] = {}  # key -> bytes now (resize_ changes it)
        self._refs: dict[int, weakref.ref] = {}  # key -> weak reference with finalizer
        self.before: dict[int, int] = {}  # key -> bytes, alive when the call started
        self.events: list[tuple[int, int, int]] = []  # (key, delta, index into _where)
        self._where: list[tuple[str, str]] = [("forward", "start")]  # (phase, op)
        self.tags: dict[int, str] = {}
        self._met: dict[int, int] = {}  # key -> its event, first met as an input inside
        self._active = False
        self._in_optimizer = False
        self._handles: list[Any] = []
        self._resize: Any = None

    # ---- what the model state is ------------------------------------------------
    def note_module(self, module: nn.Module) -> None:
        self._tag(module.parameters(), PARAMETERS)
        self._tag(module.buffers(), OTHER)
        self.note_grads(module.parameters())

    def note_grads(self, params: Iterable[torch.Tensor]) -> None:
        self._tag((p.grad for p in params if p.grad is not None), GRADIENTS)

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._tag(params, PARAMETERS)
        self.note_grads(params)
        state = (v for s in optimizer.state.values() for v in s.values())
        self._tag((v for v in state if isinstance(v, torch.Tensor)), OPTIMIZER)

    def _tag(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Follow `tensors` (alive before the call unless already met) and file their
        storages under `category` (buffers: OTHER), the stronger tag winning."""
        for t in tensors:
            for st in _storages(t):
                key = self._key(st, existed=True)
                if key is None or category == OTHER:
                    continue
                old = self.tags.get(key)
                if old is None or _PRECEDENCE.index(category) < _PRECEDENCE.index(old):
                    self.tags[key] = category

    # ---- following storages ------------------------------------------------------
    def _key(self, st: torch.UntypedStorage, *, existed: bool) -> int | None:
        """The key of `st`, following it from now on if it is new: made now (an op's
        output, `existed=False`) or alive before the call (counted from the start);
        None for another device's storage."""
        if st.device != self.device:
            return None
        key = self._keys.get(id(st))
        if key is None:
            return self._follow(st, st.nbytes(), existed=existed)
        if existed or st.nbytes() == self._sizes[key]:
            return key
        # an out= operator or aten.resize_ grew (or shrank) a storage it was given
        self._log(key, st.nbytes() - self._sizes[key])
        return key

    def _follow(self, st: torch.UntypedStorage, size: int, *, existed: bool) -> int:
        key = len(self._sizes)
        self._keys[id(st)] = key
        self._sizes[key] = size
        self._refs[key] = weakref.ref(st, lambda _, key=key, sid=id(st): self._freed(key, sid))
        if existed and not self._active:
            self.before[key] = size
        else:
            if existed:  # met inside the call: which of the two cases, `peak` decides
                self._met[key] = len(self.events)
            self.events.append((key, size, len(self._where) - 1))
        return key

    def _log(self, key: int, delta: int) -> None:
        self.events.append((key, delta, len(self._where) - 1))
        self._sizes[key] += delta

    def _freed(self, key: int, sid: int) -> None:
        # A weak-reference finalizer: the storage is being released now.
        self._keys.pop(sid, None)
        self._refs.pop(key, None)
        if self._active and self._sizes[key]:
            self._log(key, -self._sizes[key])

    def _resized(self, st: torch.UntypedStorage, old: int) -> None:
        if st.device != self.device:
            return
        key = self._keys.get(id(st))
        if key is None:  # not met before: it held `old` bytes from the start
            key = self._follow(st, old, existed=True)
        if st.nbytes() != self._sizes[key]:
            self._log(key, st.nbytes() - self._sizes[key])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Let DTensor turn into local operators first: those come back here with the
        # real storages (as MemTracker does).
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        for t in inputs:
            for st in _storages(t):
                self._key(st, existed=True)
        out = func(*args, **kwargs)
        self._where.append((self._phase(), str(func.overloadpacket.__name__)))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._key(st, existed=False)
        return out

    def _phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        return "backward" if torch._C._current_graph_task_id() >= 0 else "forward"

    # ---- on and off --------------------------------------------------------------
    def __enter__(self) -> _Counter:
        def pre_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            self.note_optimizer(optimizer)  # the gradients it is about to use
            self._in_optimizer = True

        def post_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            self._in_optimizer = False
            self.note_optimizer(optimizer)  # state made by a first step

        self._handles = [
            register_optimizer_step_pre_hook(pre_step),
            register_optimizer_step_post_hook(post_step),
        ]
        # FSDP2 frees its gathered parameters with storage.resize_(0) and gathers into
        # them again with resize_(n): not an operator, so the dispatch mode misses it.
        self._resize = torch.UntypedStorage.resize_
        original, counter = self._resize, self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            old = st.nbytes()
            result = original(st, size)
            counter._resized(st, old)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._active = False
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        for handle in self._handles:
            handle.remove()

    # ---- the peak ----------------------------------------------------------------
    def peak(self) -> dict[str, Any]:
        """Replay the log: the first moment of the largest total, and what was live."""
        # A storage first met as an operator's input inside the call and still alive
        # after it (DDP's buckets, pipeline buffers, the batch) was there from the
        # start. One freed inside the call was made there by C++ out of our sight:
        # gloo's reduce_scatter_single on CPU splits a copy of its input it made
        # itself (measured under fsdp=2: the size of every gradient, which counted
        # from the start put 3.4 MB too many into the step's peak). It counts from
        # where it was first met.
        for key, i in self._met.items():
            if key in self._refs:
                _, size, where = self.events[i]
                self.before[key] = size
                self.events[i] = (key, 0, where)
        self._met.clear()
        live = dict(self.before)
        total = best = sum(live.values())
        best_at = -1
        phase_peaks: dict[str, int] = {}
        for i, (_key, delta, where) in enumerate(self.events):
            total += delta
            if total > best:
                best, best_at = total, i
            phase = self._where[where][0]
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), total)
        live = dict(self.before)
        for key, delta, _ in self.events[: best_at + 1]:
            live[key] = live.get(key, 0) + delta
        result: dict[str, Any] = dict.fromkeys((PARAMETERS, GRADIENTS, OPTIMIZER, OTHER), 0)
        for key, size in live.items():
            result[self.tags.get(key, OTHER)] += size
        phase, op = self._where[self.events[best_at][2]] if best_at >= 0 else ("forward", "start")
        result.update(
            total=best,
            before=sum(self.before.values()),
            phase=phase,
            op=op,
            phase_peaks=phase_peaks,
        )
        return result


def profiled_peak(step_fn: Callable[[], Any]) -> int | None:
    """The peak of the same call from torch.profiler's memory profile: a slower count
    with no categories, kept as an independent check of `measure_peak`'s total. It
    starts from the allocator's own events (allocations made in C++ without an
    operator are in it) and, like measure_peak, counts a tensor alive before the call
    from the start once an operator uses it. Measured equal to measure_peak on one
    process's GPT step; recomputation adds the CPU RNG state that
    torch.utils.checkpoint saves per region (5,056 B each), made without an operator."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step_fn()  # the call runs whatever becomes of the check
    try:
        timeline = prof._memory_profile().timeline
    except AssertionError:
        # torch 2.13's profiler refuses some graphs it builds itself ("duplicate
        # outputs: ScaledDotProductFlashAttentionForCpuBackward0", seen under a plan
        # on CPU workers): no check then, rather than no measurement.
        return None
    total = best = 0
    # Sizes of allocations the profiler ties to no tensor come negative on release.
    for _, action, _, size in timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            total += abs(size)
        elif action is Action.DESTROY:
            total -= abs(size)
        best = max(best, total)
    return best
