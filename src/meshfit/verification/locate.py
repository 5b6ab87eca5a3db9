"""Where a different run departs: the first module whose output, or whose parameters'
gradient, differs from one process's at the first step (`mf.verify`'s report).

Both runs record, during their first training step, a digest of every module's output
(its first floating-point tensor) and of every parameter's gradient before the optimizer
uses it: the sum, the sum of squares and the element count, in float64. A digest adds up
over any cut of the tensor, so the pieces that ranks hold combine into the whole's
without knowing the plan: ranks that hold the same values (data-parallel replicas of a
gradient, tensor-parallel outputs made whole) report identical digests and count once;
ranks that hold different pieces (the batch split over dp, fsdp and cp, the micro-batches,
a tensor-parallel shard) are summed; a module that runs on one pipeline stage reports
from that stage's ranks only. A combined digest whose element count is not the
reference's (a piece meshfit cannot place) is not compared.

The order: outputs in forward order first (a wrong forward makes every gradient before
it wrong too, so the first output that departs is the cause); if no output departs, the
gradients in backward order (the first the backward reaches). Forwards run without
gradients (meshfit's first-step probes) and recomputation inside the backward are not
recorded.

Also here: `replica_gap`, how far apart the ranks' copies of one piece of a parameter
ended (a gradient reduced on some ranks only shows there first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshfit.verification.report import weight_differences

if TYPE_CHECKING:
    from meshfit.engine import Engine

Digest = list[float]  # [sum, sum of squares, element count]
Trace = dict[str, Any]  # {"order": [module names], "classes", "outputs", "grads"}


class FirstStepTrace:
    """Records one step's digests on this rank (`start` before the step, `finish` after).
    The gradients are read when an optimizer is about to step (torch's global step
    pre-hook: the engine's optimizer is built with the forms, on the first batch).
    Without `outputs` (a compiled step) no module gets a hook: torch.compile would trace
    them into the step, breaking its graph at every module (and recompiling per module
    name), so the step would not be the compiled program the run trains with."""

    def __init__(self, model: nn.Module, outputs: bool = True) -> None:
        self.model = model
        self.record_outputs = outputs
        self.order: list[str] = []
        self.classes: dict[str, str] = {}
        self.outputs: dict[str, Digest] = {}
        self.grads: dict[str, Digest] = {}
        self.handles: list[Any] = []

    def start(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        if self.record_outputs:
            for name, module in self.model.named_modules():
                self.handles.append(module.register_forward_hook(self._output_hook(name)))
        self.handles.append(register_optimizer_step_pre_hook(self._gradients))

    def finish(self) -> Trace:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        return {
            "order": self.order,
            "classes": self.classes,
            "outputs": self.outputs,
            "grads": self.grads,
            "outputs_recorded": self.record_outputs,
        }

    def _output_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # a probe's forward, or recomputation inside the backward
            tensor = _first_float(output)
            if tensor is None:
                return
            if name not in self.outputs:
                self.order.append(name)
                self.classes[name] = type(module).__name__
                self.outputs[name] = [0.0, 0.0, 0.0]
            _add(self.outputs[name], tensor)

        return hook

    def _gradients(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.grads:
            return  # the first step's only
        for name, param in self.model.named_parameters():
            if param.grad is not None:
                self.grads[name] = _add([0.0, 0.0, 0.0], param.grad)


def gathered(trace: Trace) -> list[Trace]:
    """Every rank's trace (on every rank; call it on every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [trace]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, trace)
    return every


# How much looser than a run's weight tolerance a digest may be off before its module is
# named: digests sum thousands of values in an order each plan chooses.
DEPARTS_FACTOR = 10


def departure(got: dict[str, Any], ref: dict[str, Any], rtol: float) -> str | None:
    """`first_departure` of two verify runs' results (None without their traces)."""
    if "trace" not in got or "trace" not in ref:
        return None
    return first_departure(got["trace"], ref["trace"], DEPARTS_FACTOR * rtol)


def first_departure(got: list[Trace], ref: list[Trace], tolerance: float) -> str | None:
    """The first module whose combined output departs from the reference's by more than
    `tolerance` (relative, see `_apart`), in the reference's forward order; else the
    first parameter's gradient in backward order; None when nothing departs."""
    order = ref[0]["order"]
    for name in order:
        apart = _apart(_combined(got, "outputs", name), ref[0]["outputs"][name])
        if apart is not None and apart > tolerance:
            shown = f"{name} ({ref[0]['classes'][name]})" if name else "the model"
            return f"the output of {shown}, {apart:.1e} apart"
    recorded = ref[0].get("outputs_recorded", True) and got[0].get("outputs_recorded", True)
    if recorded:
        rank_of = {name: i for i, name in enumerate(order)}
        params = sorted(
            ref[0]["grads"],
            key=lambda p: -rank_of.get(p.rpartition(".")[0], -1),  # the backward's order
        )
        context = "every module's output the same"
    else:  # no forward order: the parameters' own, last first (as a backward meets them)
        params = list(reversed(ref[0]["grads"]))
        context = "module outputs not recorded in a compiled step"
    for name in params:
        apart = _apart(_combined(got, "grads", name), ref[0]["grads"][name])
        if apart is not None and apart > tolerance:
            return f"the gradient of {name}, {apart:.1e} apart ({context})"
    return None


def _combined(traces: list[Trace], what: str, name: str) -> Digest | None:
    """The whole's digest from the ranks' (identical ones once, different ones summed)."""
    seen: set[tuple[float, ...]] = set()
    total = [0.0, 0.0, 0.0]
    for trace in traces:
        digest = trace[what].get(name)
        if digest is None or tuple(digest) in seen:
            continue
        seen.add(tuple(digest))
        total = [a + b for a, b in zip(total, digest, strict=True)]
    return total if seen else None


def _apart(got: Digest | None, ref: Digest) -> float | None:
    """How far two digests are apart, relative to the reference's size (None: not
    comparable): the larger of the sums of squares' relative difference and the sums'
    difference over the root of count x sum of squares (the most a sum can be)."""
    if got is None or got[2] != ref[2]:
        return None
    scale = ref[1]
    if not math.isfinite(got[0]) or not math.isfinite(got[1]):
        return math.inf
    if scale == 0:
        return 0.0 if got[1] == 0 and got[0] == 0 else math.inf
    return max(abs(got[1] - scale) / scale, abs(got[0] - ref[0]) / math.sqrt(ref[2] * scale))


def _first_float(output: Any) -> torch.Tensor | None:
    from meshfit.trees import tensors_in

    for tensor in tensors_in(output):
        if tensor.is_floating_point():
            return tensor
    return None


def _add(digest: Digest, tensor: torch.Tensor) -> Digest:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    with torch.no_grad():
        values = tensor.detach().double()
        digest[0] += float(values.sum())
        digest[1] += float((values * values).sum())
        digest[2] += values.numel()
    return digest


# ---- ranks' copies of a parameter ------------------------------------------------------


def replica_gap(engine: Engine) -> tuple[float, str | None]:
    """The largest relative difference between two ranks' copies of the same piece of a
    trained parameter, and its name ((0.0, None) when all copies are equal). A copy is
    what a rank holds of a parameter: the whole of an unsplit one (dp replicas, the
    parameters tp leaves whole, pp's tied copies), or the shard at its coordinates on
    the mesh dimensions that split it. A correct run updates every copy from the same
    gradient; copies apart mean a gradient that was not (fully) reduced, which the
    gathered state hides (it holds one rank's copy). Call on every rank."""
    import torch.distributed as dist
    import xxhash

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0, None
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    pieces = {
        _piece_key(name, p): _local(p).detach().cpu().contiguous()
        for name, p in engine.parallel_model.named_parameters()
        if id(p) in trained
    }
    digests = {
        k: xxhash.xxh3_64_hexdigest(v.view(-1).view(torch.uint8).numpy()) for k, v in pieces.items()
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    apart = {k for k in digests if len({d[k] for d in everyone if k in d}) > 1}
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, {k: pieces[k] for k in sorted(apart)})  # bitwise apart only
    worst, where = 0.0, None
    for key in sorted(apart):
        copies = [h[key] for h in held if key in h]
        for other in copies[1:]:
            gap = weight_differences({"p": other}, {"p": copies[0]})["p"]
            if gap > worst:
                worst, where = gap, key[0]
    return worst, where


def _piece_key(name: str, param: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """(name, this rank's coordinates on the mesh dimensions that split the parameter):
    the ranks with the same key hold copies of the same piece."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return name, ()
    coordinate = param.device_mesh.get_coordinate() or []
    split = [c for c, placement in zip(coordinate, param.placements, strict=False)
             if not placement.is_replicate()]  # fmt: skip
    return name, tuple(split)


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param
