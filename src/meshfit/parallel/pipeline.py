"""Pipeline parallel: the user's model cut into stages, run by torch.distributed.pipelining.

How a model is cut, without changing its code:

* Its repeated blocks (see `blocks.find_blocks`) are split into contiguous runs, one per
  stage; the cut points balance the stages' cost (measured block times when meshfit has
  an example batch, parameter counts otherwise), or come from the user (`pp_split`).
* Every stage runs the model's OWN `forward`, with the block container narrowed to the
  stage's blocks: the first block's input is replaced by the activation received from
  the previous stage, and the forward is left right after the stage's last block. So
  whatever the forward does before the blocks (embeddings, position tables, masks) is
  computed on every stage, and whatever it does after them (final norm, head) runs on
  the last one.
* Parameters registered before the block container belong to the first stage, those
  after it to the last. Other stages keep a frozen, non-persistent placeholder of the
  same shape that takes one element of memory (a zero broadcast to the shape): the
  prologue still runs there, but only for the values the blocks take besides the
  activation (masks, rotary tables), which must not depend on trained weights; a block
  input that does is refused at the first step rather than trained wrongly. Block names
  keep their original indices ("blocks.5" stays "blocks.5"), so checkpoints are the same
  model whatever the plan.

The schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble) and all point-to-point
communication are PyTorch's; meshfit builds the stages and feeds them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import BlockStack, find_blocks
from meshfit.trees import map_tensors, tensors_in

T = TypeVar("T")

# Virtual stages per rank for the interleaved schedules (Narayanan et al. 2021 use 2+;
# more shrinks the bubble further but adds point-to-point messages).
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}


class _StageExit(Exception):  # noqa: N818 - control flow, not an error
    """Raised by a hook after a stage's last block to leave the model's forward."""

    def __init__(self, output: Any) -> None:
        self.output = output


# ---- choosing cut points -----------------------------------------------------------
@dataclass
class StageCosts:
    """What the cut points were balanced on, per block (seconds or parameters)."""

    unit: str  # "s" (measured forward time) or "params"
    blocks: list[float]
    head: float = 0.0  # before the first block (goes to the first stage)
    tail: float = 0.0  # after the last block (goes to the last stage)
    activation_bytes: list[int] = field(default_factory=list)
    # Which blocks hold parameters: every stage needs one (an optimizer needs something to
    # step). Empty means all do.
    trainable: list[bool] = field(default_factory=list)


def balanced_starts(costs: StageCosts, num_stages: int) -> list[int]:
    """Index of the first block of every stage, chosen so the costliest stage is as
    cheap as possible (exact: dynamic programming over contiguous splits)."""
    n = len(costs.blocks)
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, lo: int, hi: int) -> float:
        extra = (costs.head if stage == 0 else 0.0) + (
            costs.tail if stage == num_stages - 1 else 0.0
        )
        if costs.trainable and not any(costs.trainable[lo:hi]):
            return float("inf")  # a stage of parameter-free blocks (e.g. only a Tanh)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: the best split of blocks[:i] into s+1 stages, scored by (costliest
    # stage, sum of squared stage costs): the second breaks ties towards even stages.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    choice = [[0] * (n + 1) for _ in range(num_stages)]
    for i in range(1, n + 1):
        c = stage_cost(0, 0, i)
        best[0][i] = (c, c * c)
    for s in range(1, num_stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                c = stage_cost(s, j, i)
                value = (max(best[s - 1][j][0], c), best[s - 1][j][1] + c * c)
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    if best[num_stages - 1][n][0] == float("inf"):
        raise MeshfitError(
            f"cannot give each of {num_stages} pipeline stages a block with parameters: only "
            f"{sum(costs.trainable)} of the {n} blocks have any; use fewer stages"
        )
    starts, i = [], n
    for s in range(num_stages - 1, 0, -1):
        i = choice[s][i]
        starts.append(i)
    return [0, *reversed(starts)]


def stage_costs_of(costs: StageCosts, starts: list[int]) -> list[float]:
    bounds = [*starts, len(costs.blocks)]
    totals = [sum(costs.blocks[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    totals[0] += costs.head
    totals[-1] += costs.tail
    return totals


def parameter_costs(model: nn.Module, stack: BlockStack) -> StageCosts:
    head, tail = _head_tail_parameters(model, stack)
    return StageCosts(
        unit="params",
        trainable=_trainable(stack),
        blocks=[float(sum(p.numel() for p in b.parameters())) for b in stack.blocks],
        head=float(sum(p.numel() for _, _, p in head)),
        tail=float(sum(p.numel() for _, _, p in tail)),
    )


def _measures_with_rank0(model: nn.Module) -> bool:
    """Whether this rank runs the timing forward: rank 0 alone, unless the blocks are
    already tensor-parallel; then a forward is collective over the tp group, so rank 0's
    whole tp group runs it together (rank 0 alone would wait for its peers forever)."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)  # a DTensor's mesh: the tp mesh
        if mesh is not None:
            return 0 in mesh.mesh.flatten().tolist()
    return dist.get_rank() == 0


def measure_costs(
    model: nn.Module, stack: BlockStack, example_inputs: Any, repeats: int = 3
) -> StageCosts:
    """Time each block's forward (median of `repeats` runs after a warm-up) and count
    the bytes autograd saves in it for backward (the activation memory it costs)."""
    device = next(model.parameters()).device
    marks: dict[str, list[float]] = {}
    saved = dict.fromkeys(stack.keys, 0)
    current: list[str | None] = [None]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def before(key: str) -> Callable:
        def hook(module, args):
            sync()
            current[0] = key
            marks.setdefault(key, []).append(time.perf_counter())

        return hook

    def after(key: str) -> Callable:
        def hook(module, args, output):
            sync()
            marks[key].append(time.perf_counter())
            current[0] = None

        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] is not None:
            saved[current[0]] += t.numel() * t.element_size()
        return t

    handles = []
    for key, block in zip(stack.keys, stack.blocks, strict=True):
        handles.append(block.register_forward_pre_hook(before(key)))
        handles.append(block.register_forward_hook(after(key)))
    runs: list[tuple[list[float], float, float]] = []
    try:
        for attempt in range(repeats + 1):
            marks.clear()
            if attempt == 1:
                saved.update(dict.fromkeys(saved, 0))
            sync()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(example_inputs)
            sync()
            end = time.perf_counter()
            per_block = [marks[k][1] - marks[k][0] for k in stack.keys]
            runs.append(
                (per_block, marks[stack.keys[0]][0] - start, end - marks[stack.keys[-1]][1])
            )
    finally:
        for h in handles:
            h.remove()
    runs = runs[1:]  # drop the warm-up
    return StageCosts(
        unit="s",
        blocks=[statistics.median(r[0][i] for r in runs) for i in range(len(stack.keys))],
        head=statistics.median(r[1] for r in runs),
        tail=statistics.median(r[2] for r in runs),
        activation_bytes=[saved[k] // repeats for k in stack.keys],
        trainable=_trainable(stack),
    )


def _trainable(stack: BlockStack) -> list[bool]:
    return [any(p.requires_grad for p in b.parameters()) for b in stack.blocks]


def _head_tail_parameters(
    model: nn.Module, stack: BlockStack
) -> tuple[list[tuple[nn.Module, str, nn.Parameter]], list[tuple[nn.Module, str, nn.Parameter]]]:
    """(module, name, parameter) registered before / after the block container."""
    prefix = f"{stack.name}." if stack.name else ""
    head, tail = [], []
    seen_blocks = False
    modules = dict(model.named_modules(remove_duplicate=False))
    block_params = {id(p) for p in stack.container.parameters()}
    for qualified, param in model.named_parameters(remove_duplicate=False):
        if prefix and qualified.startswith(prefix) or id(param) in block_params:
            seen_blocks = True
            continue
        owner_name, _, leaf = qualified.rpartition(".")
        entry = (modules[owner_name], leaf, param)
        (tail if seen_blocks else head).append(entry)
    head_ids = {id(p) for _, _, p in head}
    if any(id(param) in head_ids for _, _, param in tail):
        raise MeshfitError(
            "a parameter is used both before and after the blocks (tied weights, e.g. "
            "an LM head sharing the token embedding), so it cannot live on one pipeline "
            "stage; untie it (e.g. tie_word_embeddings=False) to use pp"
        )
    return head, tail


# ---- the stages --------------------------------------------------------------------
class StageModule(nn.Module):
    """What a PipelineStage runs: one stage's view of the user's model.

    The model is referenced, not registered, so it keeps its own parameter names; the
    stage's parameters are registered in `params` (PipelineStage scales and
    differentiates them).
    """

    def __init__(
        self,
        model: nn.Module,
        stack: BlockStack,
        keys: list[str],
        *,
        is_first: bool,
        is_last: bool,
        params: list[nn.Parameter],
        autocast: Callable[[], contextlib.AbstractContextManager],
        outside: list[tuple[str, nn.Module, str]] = (),
        units: list[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_stack", stack)
        self.keys = keys
        self.is_first, self.is_last = is_first, is_last
        if units is None:
            self.params = nn.ParameterList(params)
        else:  # the modules holding `params` (FSDP units under a root on this module)
            self.units = nn.ModuleList(units)
        self._autocast = autocast
        self._outside = list(outside)  # (name, module, "before"/"after" the blocks)
        self._checked = False

    def forward(self, hidden_or_inputs: Any, model_inputs: Any = None) -> Any:
        model, container = self._model, self._stack.container
        inputs = hidden_or_inputs if self.is_first else model_inputs
        blocks = {k: container._modules[k] for k in self.keys}
        everything = container._modules
        handles = []
        if not self.is_first:
            handles.append(
                blocks[self.keys[0]].register_forward_pre_hook(
                    _replace_first_arg(hidden_or_inputs), with_kwargs=True
                )
            )
        checking = not self._checked  # the first forward only: free afterwards
        if checking:
            self._checked = True
            handles += _check_the_split(blocks, self._stack, self._outside)
        if not self.is_last:  # after the checks: hooks run in the order they were added
            handles.append(blocks[self.keys[-1]].register_forward_hook(_leave_forward))
        # The checks read requires_grad, so they need autograd on, also in an evaluation.
        untracked = checking and not torch.is_grad_enabled()
        container._modules = blocks  # the forward's loop sees only this stage's blocks
        try:
            with self._autocast(), torch.enable_grad() if untracked else contextlib.nullcontext():
                output = type(model).forward(model, inputs)
        except _StageExit as leave:
            output = leave.output
        finally:
            container._modules = everything
            for h in handles:
                h.remove()
        return map_tensors(output, torch.Tensor.detach) if untracked else output


def _replace_first_arg(hidden: torch.Tensor) -> Callable:
    def hook(module, args, kwargs):
        if not args:
            raise MeshfitError(
                f"pipeline parallel needs the blocks to take the hidden state as their "
                f"first positional argument; {type(module).__name__} got keywords only"
            )
        return (hidden, *args[1:]), kwargs

    return hook


def _check_the_split(
    blocks: dict[str, nn.Module], stack: BlockStack, outside: list[tuple[str, nn.Module, str]]
) -> list[Any]:
    """Hooks that refuse, at a stage's first forward (before any update), a model that
    the cut would train wrongly instead of letting it run: a module outside the blocks
    that runs on the other side of them than where it was registered, or a block input
    besides the hidden state that carries gradients."""
    keys = list(blocks)
    phase = ["before"]

    def enter(module, args):
        phase[0] = "between"

    def leave(module, args, output):
        phase[0] = "after"

    handles = [blocks[keys[0]].register_forward_pre_hook(enter)]
    handles.append(blocks[keys[-1]].register_forward_hook(leave))
    for key, block in blocks.items():
        check = _refuse_trained_side_inputs(stack.qualified(key))
        handles.append(block.register_forward_pre_hook(check, with_kwargs=True))
    for name, module, side in outside:
        handles.append(module.register_forward_pre_hook(_refuse_misplaced(name, side, phase)))
    return handles


def _refuse_misplaced(name: str, side: str, phase: list[str]) -> Callable:
    """Weights registered before the blocks go to the first stage and those after them
    to the last, which is right only if the module runs on that side of the blocks."""

    def hook(module, args):
        if phase[0] != side:
            where = "between the blocks" if phase[0] == "between" else f"{phase[0]} them"
            fix = "after" if side == "before" else "before"
            raise MeshfitError(
                f"pipeline parallel cannot split this model: {name!r} is registered "
                f"{side} the blocks, so its weights go to the "
                f"{'first' if side == 'before' else 'last'} stage, but it runs {where}. "
                f"Assign it {fix} the block stack in __init__ (meshfit reads the side from "
                f"the order of registration), or train with dp/fsdp/tp instead of pp"
            )

    return hook


def _refuse_trained_side_inputs(name: str) -> Callable:
    """A block's inputs besides the hidden state must not carry gradients: a stage
    receives only the hidden state, so a side input computed from trained weights (a
    skip from the embeddings, a gate registered outside the blocks) would be recomputed
    from another stage's placeholder and its gradient lost. Checked before any update."""

    def hook(module, args, kwargs):
        sides = [(f"positional argument {i}", a) for i, a in enumerate(args[1:], start=2)]
        sides += [(f"keyword {k!r}", v) for k, v in kwargs.items()]
        for where, value in sides:
            if any(t.requires_grad for t in tensors_in(value)):
                raise MeshfitError(
                    f"pipeline parallel cannot split this model: block {name!r} takes "
                    f"{where} besides the hidden state, and it depends on trained weights "
                    f"outside the blocks (e.g. a skip connection from the embeddings); a "
                    f"pipeline stage receives only the hidden state. Compute that input "
                    f"inside the blocks, or train with dp/fsdp/tp instead of pp"
                )
        return None

    return hook


def reported_dtype(model: nn.Module) -> torch.dtype:
    """The dtype losses are reported in: the model's floating dtype, at least float32
    (a float64 model reports float64 losses; a bf16 one float32)."""
    for p in model.parameters():
        if p.is_floating_point():
            return torch.promote_types(p.dtype, torch.float32)
    return torch.float32


def _leave_forward(module, args, output):
    raise _StageExit(output[0] if isinstance(output, (tuple, list)) else output)


def _refuse_direct_call(module, args):
    raise MeshfitError(
        "this model is split over pipeline stages (plan pp>1); call engine.step / "
        "engine.evaluate, or get the whole model with engine.full_state_dict()"
    )


@dataclass
class Pipeline:
    model: nn.Module  # the user's model, pruned to this rank's stages
    stages: list[PipelineStage]
    schedule: Any
    group: dist.ProcessGroup
    has_first: bool
    has_last: bool
    starts: list[int]  # first block index of every stage
    costs: StageCosts
    block_names: list[str]

    @property
    def last_rank(self) -> int:
        """Global rank that holds the last stage (where the loss is)."""
        return dist.get_global_rank(self.group, dist.get_world_size(self.group) - 1)

    def describe(self) -> str:
        bounds = [*self.starts, len(self.block_names)]
        totals = stage_costs_of(self.costs, self.starts)
        parts = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            cost = (
                f"{totals[i] * 1e3:.2f} ms"
                if self.costs.unit == "s"
                else f"{totals[i] / 1e6:.2f}M params"
            )
            parts.append(f"stage {i}: blocks {a}-{b - 1} ({cost})")
        how = "measured forward time" if self.costs.unit == "s" else "parameter count"
        return f"pipeline cut by {how}: " + "; ".join(parts)

    def run(self, inputs: Any, targets: Any, train: bool) -> torch.Tensor:
        """One pass of the schedule over this rank's share; returns the mean loss over
        it on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        if train:
            self.schedule.step(*args, target=target, losses=losses, model_inputs=inputs)
        else:
            self.schedule.eval(*args, target=target, losses=losses, model_inputs=inputs)
        device = self.stages[0].device
        # Every rank must broadcast the same dtype; only the last stage sees the loss,
        # so all of them use the reporting dtype of the model's floating parameters.
        dtype = reported_dtype(self.model)
        if self.has_last:
            loss = torch.stack([x.detach().to(dtype) for x in losses]).mean()
        else:
            loss = torch.zeros((), device=device, dtype=dtype)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss


@dataclass
class PipelineSplit:
    """Where the model was cut and what this rank keeps (see `split_model`)."""

    stack: BlockStack
    stage_keys: list[list[str]]  # block keys of every stage
    mine: list[int]  # the stages this rank runs
    head: list[tuple[nn.Module, str, nn.Parameter]]
    tail: list[tuple[nn.Module, str, nn.Parameter]]
    starts: list[int]
    costs: StageCosts
    schedule: str
    group: dist.ProcessGroup
    pp: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_keys)

    @property
    def has_first(self) -> bool:
        return 0 in self.mine

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.mine

    def trained_modules(self) -> list[nn.Module]:
        """This rank's modules with trained parameters: its blocks, and the modules
        before / after them when it runs the first / last stage (units for FSDP)."""
        return _unique([m for s in self.mine for m in self._owners(s)])

    def stage_modules(self, stage: int) -> list[nn.Module] | None:
        """The modules holding stage `stage`'s parameters, or None when one of them also
        holds the blocks (a parameter registered on the model itself)."""
        owners = self._owners(stage)
        if any(_encloses(m, self.stack.container) for m in owners):
            return None
        return owners

    def _owners(self, stage: int) -> list[nn.Module]:
        blocks = self.stack.container._modules
        modules = [blocks[k] for k in self.stage_keys[stage]]
        if stage == 0:
            modules = [m for m, _, _ in self.head] + modules
        if stage == self.num_stages - 1:
            modules += [m for m, _, _ in self.tail]
        return _unique(modules)

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """Looked up now, not at the split: sharding replaces parameter objects."""
        blocks = self.stack.container._modules
        params = [p for k in self.stage_keys[stage] for p in blocks[k].parameters()]
        if stage == 0:
            params = [getattr(m, leaf) for m, leaf, _ in self.head] + params
        if stage == self.num_stages - 1:
            params += [getattr(m, leaf) for m, leaf, _ in self.tail]
        return _unique(params)


def split_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    schedule: str,
    split: list[int] | None = None,
    example_inputs: Any = None,
) -> PipelineSplit:
    """Choose the cut points over `mesh` (a 1-D pp mesh) and prune `model` in place to
    this rank's stages (blocks kept under their original names; head/tail parameters
    that another rank trains become frozen, non-persistent buffers)."""
    pp = mesh.size()
    rank = mesh.get_local_rank()
    virtual = VIRTUAL_STAGES[schedule]
    num_stages = pp * virtual
    stack = find_blocks(model)
    n = len(stack.keys)
    if n < num_stages:
        raise MeshfitError(
            f"pp={pp} with schedule {schedule!r} needs {num_stages} stages but "
            f"{type(model).__name__} has only {n} blocks in {stack.name or 'the model'!r}; "
            f"use pp <= {n // virtual}" + (" or schedule='1f1b'" if virtual > 1 else "")
        )
    head, tail = _head_tail_parameters(model, stack)

    if split is not None:
        starts = _check_split(split, n, num_stages)
        costs = parameter_costs(model, stack)
    else:
        if example_inputs is not None:
            # Every rank must cut at the same place, so rank 0 measures (alone, so that
            # workers sharing its cores do not disturb the timing) and tells the others.
            measures = _measures_with_rank0(model)
            shared = [measure_costs(model, stack, example_inputs) if measures else None]
            dist.broadcast_object_list(shared, src=0)
            costs = shared[0]
        else:
            costs = parameter_costs(model, stack)
        starts = balanced_starts(costs, num_stages)
    bounds = [*starts, n]
    stage_keys = [stack.keys[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    mine = list(range(rank, num_stages, pp))  # looped assignment: rank r holds r, r+pp, ...
    result = PipelineSplit(stack=stack, stage_keys=stage_keys, mine=mine, head=head, tail=tail,
                           starts=starts, costs=costs, schedule=schedule, group=mesh.get_group(),
                           pp=pp)  # fmt: skip

    owned = {k for s in mine for k in stage_keys[s]}
    for key in list(stack.keys):
        if key not in owned:
            del stack.container._modules[key]
    for part, keep in ((head, result.has_first), (tail, result.has_last)):
        if not keep:
            for module, leaf, param in part:
                if leaf in module._parameters:
                    del module._parameters[leaf]
                    module.register_buffer(leaf, _placeholder(param), persistent=False)
    model.register_forward_pre_hook(_refuse_direct_call)
    for s in mine:
        if not result.stage_parameters(s):
            raise MeshfitError(
                f"pipeline stage {s} ({', '.join(stack.qualified(k) for k in stage_keys[s])}) "
                f"would hold no parameters; give cut points that put a layer with weights "
                f"on every stage (pp_split=[...]) or use a smaller pp"
            )
    return result


def build_pipeline(
    model: nn.Module,
    split: PipelineSplit,
    *,
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
    wrap_stage: Callable[[nn.Module], nn.Module] | None = None,
    register_units: bool = False,
) -> Pipeline:
    """The PipelineStages of this rank and the schedule that runs them. `wrap_stage`
    wraps each stage's module (e.g. in DDP for data parallel over pipelines);
    `register_units` makes the modules holding a stage's parameters its submodules (so
    an FSDP root over the stage module has the FSDP units below it)."""
    stages = []
    outside = _modules_outside(model, split.stack, split.head, split.tail)
    for s in split.mine:
        module: nn.Module = StageModule(
            model, split.stack, split.stage_keys[s], is_first=s == 0,
            is_last=s == split.num_stages - 1, params=split.stage_parameters(s),
            autocast=autocast, outside=outside,
            units=split.stage_modules(s) if register_units else None,
        )  # fmt: skip
        if wrap_stage is not None:
            module = wrap_stage(module)
        stages.append(PipelineStage(module, s, split.num_stages, device, group=split.group))

    checked_loss = _scalar_loss(loss_fn)
    schedule, pp = split.schedule, split.pp
    if VIRTUAL_STAGES[schedule] == 1:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], microbatches, loss_fn=checked_loss)
    else:
        if microbatches % pp:
            raise MeshfitError(
                f"schedule {schedule!r} needs microbatches to be a multiple of pp={pp}, "
                f"not {microbatches}; use microbatches={max(pp, microbatches // pp * pp)}"
            )
        cls = (
            ScheduleInterleaved1F1B
            if schedule == "interleaved-1f1b"
            else ScheduleInterleavedZeroBubble
        )
        sched = cls(stages, microbatches, loss_fn=checked_loss)
    return Pipeline(
        model=model, stages=stages, schedule=sched, group=split.group,
        has_first=split.has_first, has_last=split.has_last, starts=split.starts,
        costs=split.costs,
        block_names=[split.stack.qualified(k) for k in _all_keys(split)],
    )  # fmt: skip


def _modules_outside(
    model: nn.Module, stack: BlockStack, head: list[tuple], tail: list[tuple]
) -> list[tuple[str, nn.Module, str]]:
    """The modules that own the weights before / after the blocks, with their names;
    not the model or a module around the blocks (their forward encloses the blocks)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    found: dict[int, tuple[str, nn.Module, str]] = {}
    for part, side in ((head, "before"), (tail, "after")):
        for module, _, _ in part:
            if not _encloses(module, stack.container):
                found.setdefault(id(module), (names[id(module)], module, side))
    return list(found.values())


def _encloses(module: nn.Module, container: nn.Module) -> bool:
    return any(c is container for c in module.modules())


def _placeholder(param: nn.Parameter) -> torch.Tensor:
    """What a stage keeps of a parameter another stage trains. Its values never reach
    the loss (the prologue's output is replaced by the received activation; the
    epilogue never runs), so one zero broadcast to the shape does: an embedding of
    50k x 1024 fp32 costs 4 bytes instead of 206 MB. A DTensor (from a user's tp plan)
    stays a detached copy, as its module's hooks expect one."""
    if hasattr(param, "device_mesh"):
        return param.detach()
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


def _all_keys(split: PipelineSplit) -> list[str]:
    return [k for keys in split.stage_keys for k in keys]


def _unique(items: list[T]) -> list[T]:
    """`items` without repeats, by identity (parameters or modules), in order."""
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def _check_split(split: list[int], n: int, num_stages: int) -> list[int]:
    starts = [0, *split]
    if (
        len(split) != num_stages - 1
        or any(not isinstance(s, int) for s in split)
        or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
        or starts[-1] >= n
    ):
        raise MeshfitError(
            f"pp_split={split!r} must list the {num_stages - 1} block indices where stages "
            f"2..{num_stages} begin, increasing, each between 1 and {n - 1} (the model has "
            f"{n} blocks)"
        )
    return starts


def _scalar_loss(loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable:
    def loss(outputs: Any, targets: Any) -> torch.Tensor:
        value = loss_fn(outputs, targets)
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            raise MeshfitError(
                "loss_fn must return one number, the mean loss over the batch; use a mean "
                "reduction (e.g. reduction='mean')"
            )
        return value

    return loss
