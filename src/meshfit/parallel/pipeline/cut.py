"""Cutting the user's model into pipeline stages, in place, without changing its code.

The repeated blocks (`blocks.find_blocks`) are split into contiguous runs, one per stage
(cut points from `costs.balanced_starts`, or the user's `pp_split`). Each rank keeps its
stages' blocks under their original names ("blocks.5" stays "blocks.5", so checkpoints
are the same model whatever the plan). Parameters registered before the block container
belong to the first stage, those after it to the last; a rank that does not train them
keeps a frozen, non-persistent placeholder of the same shape instead (see
`_placeholder`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import BlockStack, find_blocks
from meshfit.parallel.pipeline.arguments import arguments_on_meta
from meshfit.parallel.pipeline.checks import (
    _check_the_split,
    _modules_outside,
    _side_effects_undone,
    _Threaded,
    plain_attributes,
    settle_sides,
)
from meshfit.parallel.pipeline.costs import (
    StageCosts,
    _measures_with_rank0,
    balanced_starts,
    count_costs,
    parameter_costs,
    starts_keeping_arguments,
)
from meshfit.parallel.pipeline.tied import TiedWeights, check_placements, find_tied, tie_stages
from meshfit.plan import VIRTUAL_STAGES

T = TypeVar("T")

# Stages per rank of each schedule: the interleaved ones loop over virtual stages
# (Narayanan et al. 2021 use 2+; more shrinks the bubble further but adds messages).


def _head_tail_parameters(
    model: nn.Module, stack: BlockStack
) -> tuple[list[tuple[nn.Module, str, nn.Parameter]], list[tuple[nn.Module, str, nn.Parameter]]]:
    """(module, name, parameter) registered before / after the block container. A
    parameter used on both sides (a tied LM head) is in both lists (see `tied`)."""
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
    return head, tail


def _head_tail_state(model: nn.Module, stack: BlockStack) -> tuple[frozenset[str], frozenset[str]]:
    """The state-dict keys (parameters and persistent buffers) registered before / after
    the blocks, by the state dict's own order (registration order)."""
    blocks = tuple(f"{stack.qualified(k)}." for k in stack.keys)
    head, tail = set(), set()
    seen_blocks = False
    for key in model.state_dict(keep_vars=True):
        if key.startswith(blocks):
            seen_blocks = True
        else:
            (tail if seen_blocks else head).add(key)
    return frozenset(head), frozenset(tail)


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
    tied: TiedWeights | None = None  # weights held by the first and the last stage
    # state-dict keys outside the blocks, registered before / after them: the first /
    # the last stage owns them (every stage keeps the modules, which run its prologue)
    head_state: frozenset[str] = frozenset()
    tail_state: frozenset[str] = frozenset()
    # {block key: side inputs the block before hands it, computed from trained weights
    # (T5's position bias)}: they cross a cut before that block with the hidden state.
    # None: no forward looked (no example_inputs); a stage refuses any it meets.
    carried: dict[str, list] | None = None
    # {block key: its plain attributes} for the blocks that start a stage: the previous
    # stage's forward reads them off the stand-in in that block's place (stage.py)
    block_attributes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def foreign_state(self) -> frozenset[str]:
        """Keys of this rank's state dict that another stage owns: a BatchNorm before the
        blocks has running statistics on every stage, but only the first one's are the
        model's (the others ran it on stand-in weights)."""
        foreign: set[str] = set()
        if not self.has_first:
            foreign |= self.head_state
        if not self.has_last:
            foreign |= self.tail_state
        return frozenset(foreign)

    @property
    def num_stages(self) -> int:
        return len(self.stage_keys)

    @property
    def has_first(self) -> bool:
        return 0 in self.mine

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.mine

    @property
    def block_names(self) -> list[str]:
        return [self.stack.qualified(k) for keys in self.stage_keys for k in keys]

    def owners(self, stage: int) -> list[nn.Module]:
        """The modules holding stage `stage`'s parameters: its blocks, and the modules
        before / after them for the first / last stage."""
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
    ends_group: Callable[[], dist.ProcessGroup | None] | None = None,
    valued_inputs: Any = None,
    before_pruning: Callable[[], None] | None = None,
) -> PipelineSplit:
    """Choose the cut points over `mesh` (a 1-D pp mesh) and prune `model` in place to
    this rank's stages (blocks kept under their original names; head/tail parameters
    that another rank trains become frozen, non-persistent buffers; a weight tied
    across the blocks is kept by the first and the last stage, see `tied`).
    `ends_group` makes the group of each pipeline's first and last rank, where a tied
    weight's two copies live (Topology.pipeline_ends_group; default: the pp group,
    which is that group for pp=2). `valued_inputs`: the example with its values, where
    `example_inputs` is on meta beside a model on meta (arguments_on_meta reads them).
    `before_pruning`: called once the cut is chosen and checked, before the model is
    pruned (a refusal there leaves the model whole)."""
    if valued_inputs is None:
        valued_inputs = example_inputs
    pp = mesh.size()
    rank = mesh.get_local_rank()
    virtual = VIRTUAL_STAGES[schedule]
    num_stages = pp * virtual
    stack = find_blocks(model)
    n = len(stack.keys)
    if n < num_stages:
        fixes = [f"pp <= {n // virtual}"] if n // virtual >= 2 else []
        if virtual > 1 and n >= pp:
            fixes.append("schedule='1f1b'")
        # fewer than 2 blocks (ALBERT's one shared layer group): "use pp <= 1" was no fix
        fix = " or ".join(fixes) or "dp, fsdp or tp (pipeline parallel cuts 2 blocks or more)"
        raise MeshfitError(
            f"pp={pp} with schedule {schedule!r} needs {num_stages} stages but "
            f"{type(model).__name__} has only {n} block{'s' if n != 1 else ''} in "
            f"{stack.name or 'the model'!r}; use {fix}"
        )
    head, tail = _head_tail_parameters(model, stack)
    head_state, tail_state = _head_tail_state(model, stack)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    tied = find_tied(head, tail, names)

    counted: StageCosts | None = None
    carried: dict[str, list] | None = None
    if example_inputs is not None:
        # Every rank must cut at the same place: rank 0 counts the FLOPs (the same on
        # every rank; one forward is enough) and tells the others. Its forward also runs
        # the checks a stage's first forward would run, so a model the cut would train
        # wrongly is refused here, on every rank alike (at a stage's first forward only
        # that stage's rank can refuse, and the others wait for its activation until the
        # launcher stops them), and finds the side inputs that cross the cuts.
        measures = _measures_with_rank0(model)
        shared: list[Any] = [None]
        if measures:
            try:
                with _checked(model, stack, head, tail) as found, _side_effects_undone(model):
                    counted = count_costs(model, stack, example_inputs)
                shared[0] = (counted, found.carried, found.moved)
            except MeshfitError as refusal:
                shared[0] = str(refusal)
            except Exception:  # noqa: BLE001 - see below
                if not next(model.parameters()).is_meta:
                    raise
                # A model on meta whose forward reads values (a mask's .item()) cannot
                # run there: its stages are balanced by parameter count (the start-up
                # line says so), and each stage checks its first forward itself; what
                # its blocks are given is read from its prologue alone (arguments.py)
                by_count = parameter_costs(stack, head, tail)
                by_count.arguments = arguments_on_meta(model, stack, valued_inputs)
                shared[0] = (by_count, None, {})
        dist.broadcast_object_list(shared, src=0)
        if isinstance(shared[0], str):
            raise MeshfitError(shared[0])
        counted, carried, moved = shared[0]
        if moved:  # weights go where their module runs (its registration said otherwise)
            head, tail = _by_execution(head, tail, moved, names)
            head_state, tail_state = _state_by_execution(head_state, tail_state, moved)
            tied = find_tied(head, tail, names)
    # where a stage's loop, counting its blocks from 0, gives them their own arguments
    allowed = starts_keeping_arguments(counted, carried) if counted is not None else None
    if split is not None:
        starts = _check_split(split, n, num_stages, allowed)
        costs = parameter_costs(stack, head, tail)
    else:
        costs = counted if counted is not None else parameter_costs(stack, head, tail)
        starts = balanced_starts(costs, num_stages, allowed)
    bounds = [*starts, n]
    stage_keys = [stack.keys[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    mine = list(range(rank, num_stages, pp))  # looped assignment: rank r holds r, r+pp, ...
    result = PipelineSplit(
        stack=stack,
        stage_keys=stage_keys,
        mine=mine,
        head=head,
        tail=tail,
        starts=starts,
        costs=costs,
        schedule=schedule,
        group=mesh.get_group(),
        pp=pp,
        head_state=head_state,
        tail_state=tail_state,
        carried=carried,
        block_attributes={
            keys[0]: plain_attributes(stack.blocks[stack.keys.index(keys[0])])
            for keys in stage_keys[1:]
        },
    )

    if before_pruning is not None:
        before_pruning()
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
    if tied:
        check_placements(tied)
        group = ends_group() if ends_group is not None else mesh.get_group()
        result.tied = tie_stages(tied, mesh, mine, group)
        result.tied.broadcast_values()
    model.register_forward_pre_hook(_refuse_direct_call)
    for s in mine:
        if not result.stage_parameters(s):
            raise MeshfitError(
                f"pipeline stage {s} ({', '.join(stack.qualified(k) for k in stage_keys[s])}) "
                f"would hold no parameters; give cut points that put a layer with weights "
                f"on every stage (pp_split=[...]) or use a smaller pp"
            )
    return result


@dataclass
class CheckFound:
    """What the check forward found: the side inputs that cross each cut ({block key:
    where in its call}) and the modules outside the blocks that run on the other side
    of them than they are registered ({name: "before" / "after"})."""

    carried: dict[str, list] = field(default_factory=dict)
    moved: dict[str, str] = field(default_factory=dict)


def _by_execution(
    head: list[tuple], tail: list[tuple], moved: dict[str, str], names: dict[int, str]
) -> tuple[list[tuple], list[tuple]]:
    """head / tail with the parameters of the `moved` modules on the side they run."""
    new_head = [e for e in head if moved.get(names[id(e[0])], "before") == "before"]
    new_tail = [e for e in tail if moved.get(names[id(e[0])], "after") == "after"]
    new_head += [e for e in tail if moved.get(names[id(e[0])]) == "before"]
    new_tail += [e for e in head if moved.get(names[id(e[0])]) == "after"]
    return new_head, new_tail


def _state_by_execution(
    head: frozenset[str], tail: frozenset[str], moved: dict[str, str]
) -> tuple[frozenset[str], frozenset[str]]:
    """head_state / tail_state with the keys of the `moved` modules on the side they run."""
    side = {key: moved.get(key.rpartition(".")[0]) for key in head | tail}
    new_head = {k for k in head if side[k] in (None, "before")} | {
        k for k in tail if side[k] == "before"
    }
    new_tail = {k for k in tail if side[k] in (None, "after")} | {
        k for k in head if side[k] == "after"
    }
    return frozenset(new_head), frozenset(new_tail)


@contextlib.contextmanager
def _checked(model: nn.Module, stack: BlockStack, head: list[tuple], tail: list[tuple]):
    """The whole model's forward with the checks of a stage's first forward, over all
    the blocks (see stage._check_the_split). Frozen parameters outside the blocks
    require a gradient while it runs, so a block's input computed from one is seen as
    the check sees one computed from a trained weight: on a later stage that weight is a
    placeholder (RoFormer's sinusoidal table, frozen: its second stage's layers were
    rotated by a table of zeros' output, 5.7e-8 apart at the first step in float64 and
    growing, with no word)."""

    blocks = dict(zip(stack.keys, stack.blocks, strict=True))
    outside = _modules_outside(model, stack, head, tail)
    found = CheckFound()
    runs: dict[str, set[str]] = {}
    frozen = _unique(
        [p for _, _, p in (*head, *tail) if not p.requires_grad and p.is_floating_point()]
    )
    handles = _check_the_split(
        blocks, stack, outside, model=model, threaded=_Threaded(), found=found.carried, runs=runs
    )
    try:
        for param in frozen:
            param.requires_grad_(True)
        yield found
    finally:
        for param in frozen:
            param.requires_grad_(False)
        for handle in handles:
            handle.remove()
    found.moved = settle_sides(outside, runs)


def _refuse_direct_call(module, args):
    raise MeshfitError(
        "this model is split over pipeline stages (plan pp>1); call engine.step / "
        "engine.evaluate, or get the whole model with engine.full_state_dict()"
    )


def _placeholder(param: nn.Parameter) -> torch.Tensor:
    """What a stage keeps of a parameter another stage trains. Its values never reach
    the loss (the prologue's output is replaced by the received activation; the
    epilogue never runs), so one zero broadcast to the shape does: an embedding of
    50k x 1024 fp32 costs 4 bytes instead of 206 MB. A DTensor (from a user's tp plan)
    stays a detached copy, as its module's hooks expect one."""
    if isinstance(param, DTensor):
        return param.detach()
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


def _unique(items: list[T]) -> list[T]:
    """`items` without repeats, by identity (parameters or modules), in order."""
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def _check_split(
    split: list[int], n: int, num_stages: int, allowed: list[bool] | None = None
) -> list[int]:
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
    wrong = [s for s in split if allowed is not None and not allowed[s]]
    if wrong:
        kept = [i for i, ok in enumerate(allowed) if ok and i > 0]
        raise MeshfitError(
            f"pp_split={split!r} starts a stage at block {wrong[0]}, where the model's forward "
            f"would give that stage's blocks other arguments than their own: it picks each "
            f"block's by its place in the loop (a mask or rotary table per layer type), and "
            f"a stage's loop counts from 0; start stages at blocks from {kept[:12]}"
        )
    return starts
