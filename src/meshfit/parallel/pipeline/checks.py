"""The checks a pipeline cut runs before any update: the whole model's check forward on
example_inputs (cut.py, on rank 0, its verdict broadcast) and each stage's first
forward (stage.py) refuse a model the cut would train wrongly, and find what must cross
a cut besides the hidden state (T5's position bias) and where each module outside the
blocks runs (OPT's final norm, registered before the blocks and run after them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshfit.coupling.buffers import updates_discarded
from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import BlockStack
from meshfit.trees import tensors_in


@contextlib.contextmanager
def _side_effects_undone(model: nn.Module):
    """Run a forward without leaving a trace: BatchNorm layers do not update their
    running statistics (the metadata forward on uninitialised tensors made them NaN,
    measured), any other buffer the forward updates is a copy thrown away after
    (coupling/buffers.updates_discarded: swapped back, not copied back, as torch keeps
    this forward's graph for a backward of its own) and the random-number state
    (dropout) is put back afterwards."""
    from torch.nn.modules.batchnorm import _BatchNorm

    tracking = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    for layer in tracking:
        layer.track_running_stats = False
    try:
        with updates_discarded(model):
            yield
    finally:
        for layer in tracking:
            layer.track_running_stats = True
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


# Where a side input sits in a block's call: ("arg", index in args) or ("kw", name).
Where = tuple[str, "int | str"]


def _side_inputs(args: tuple, kwargs: dict) -> list[tuple[Where, Any]]:
    """A block call's inputs besides the hidden state (its first positional argument)."""
    sides: list[tuple[Where, Any]] = [(("arg", i), a) for i, a in enumerate(args[1:], start=1)]
    return sides + [(("kw", k), v) for k, v in kwargs.items()]


def _described(where: Where) -> str:
    kind, at = where
    return f"positional argument {at + 1}" if kind == "arg" else f"keyword {at!r}"


class _Threaded:
    """The tensors the last block returned (held, compared by identity): a side input
    among them is threaded from block to block by the forward's loop (T5's position
    bias), so it can cross a cut with the hidden state."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def note(self, module, args, output) -> None:
        self.outputs = tensors_in(output)

    def holds(self, tensor: torch.Tensor) -> bool:
        return any(tensor is t for t in self.outputs)


def _check_the_split(
    blocks: dict[str, nn.Module],
    stack: BlockStack,
    outside: list[tuple[str, nn.Module, str]],
    model: nn.Module | None = None,
    *,
    threaded: _Threaded,
    found: dict[str, list[Where]] | None = None,
    given: set[Where] = frozenset(),
    runs: dict[str, set[str]] | None = None,
) -> list[Any]:
    """Hooks that refuse, at a stage's first forward (before any update), a model that
    the cut would train wrongly instead of letting it run: a module outside the blocks
    that runs on the other side of them than where it was registered, or a block input
    besides the hidden state that carries gradients and does not come from the block
    before it. Those that do are recorded in `found` (the whole model's check forward);
    `given` are those this stage received with the hidden state, at its first block.
    With `runs` (the whole model's check forward), where each module outside the blocks
    runs is recorded there instead ({name: phases}), for the cut to place it by
    (`settle_sides`)."""
    keys = list(blocks)
    phase = ["before"]

    def enter(module, args):
        phase[0] = "between"

    def leave(module, args, output):
        phase[0] = "after"

    handles = [blocks[keys[0]].register_forward_pre_hook(enter)]
    handles.append(blocks[keys[-1]].register_forward_hook(leave))
    if model is not None:  # checked over several forwards: each starts before the blocks
        handles.append(model.register_forward_pre_hook(lambda m, a: phase.__setitem__(0, "before")))
    for i, (key, block) in enumerate(blocks.items()):
        allowed = given if i == 0 else frozenset()
        check = _side_input_check(stack.qualified(key), key, found, threaded, allowed=allowed)
        handles.append(block.register_forward_pre_hook(check, with_kwargs=True))
        handles.append(block.register_forward_hook(threaded.note))
    for name, module, side in outside:
        if runs is None:
            hook = _refuse_misplaced(name, side, phase)
        else:
            hook = lambda m, a, name=name: runs.setdefault(name, set()).add(phase[0])  # noqa: E731
        handles.append(module.register_forward_pre_hook(hook))
    if model is not None:
        handles += _refuse_prologue_read_after(model, blocks, outside, phase, stack.name)
        handles += _refuse_blocks_run_again(model, blocks, stack.name)
    return handles


def _refuse_blocks_run_again(
    model: nn.Module, blocks: dict[str, nn.Module], container: str
) -> list[Any]:
    """Hooks for the whole model's check forward: each block must run once per forward,
    in the container's order, as a stage runs its own. A forward that loops over its
    blocks more than once (a recurrent-depth model running its stack twice, a shared
    block called from several places) would run a later stage's blocks in every loop
    but the first stage's only up to the cut: a stack looped twice under pp=2 trained
    30% apart from one process with no word. Refused at the block called again, before
    any update."""
    index = {id(block): i for i, block in enumerate(blocks.values())}
    last = [-1]

    def start(module, args):
        last[0] = -1

    def block_called(module, args):
        i = index[id(module)]
        if i <= last[0]:
            raise MeshfitError(
                f"pipeline parallel cannot split this model: its forward calls block {i} of "
                f"{container!r} again after block {last[0]} in one forward (a loop over the "
                f"blocks run more than once, or a block shared by several places), and a "
                f"stage runs each of its blocks once, in order; train with dp, fsdp or tp "
                f"instead of pp (or name a container whose blocks run once each with "
                f"blocks='...')"
            )
        last[0] = i

    handles = [model.register_forward_pre_hook(start)]
    handles += [block.register_forward_pre_hook(block_called) for block in blocks.values()]
    return handles


def _refuse_prologue_read_after(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    outside: list[tuple[str, nn.Module, str]],
    phase: list[str],
    container: str,
) -> list[Any]:
    """Hooks for the whole model's check forward: a module outside the blocks that runs
    before them lives on the first stage, and on later stages it runs on stand-in weights
    (its output is replaced by the received activation, or feeds only what depends on
    no trained weight). If the model reads its output after the blocks other than through
    them (CLIP's vision tower, run before the text tower's blocks, its embeddings read by
    the loss), the last stage would compute with the stand-ins: measured NaN losses.
    Refused: the output's autograd graph, walked from the model's output, reaches such a
    module's output without passing through the blocks. The walk stops at the last
    block's input and output, which every cut computes (or receives) on the last stage;
    not at the first block's input: read again after the blocks (a residual around all
    of them: transformers' ResNet bottleneck, whose inner convolutions were the blocks,
    added its input back after them) it is the first stage's, and that model trained
    7% apart from one process under pp=2 with no word."""
    made: dict[Any, str] = {}  # grad_fn of a prologue module's output -> its name
    stops: set[Any] = set()  # grad_fn of the last block's input and outputs
    seen_at_blocks: list[torch.Tensor] = []  # what entered or left a block (by identity)
    last = list(blocks.values())[-1]

    def prologue_output(name: str) -> Callable:
        def hook(module, args, output):
            if phase[0] != "before":
                return
            for t in tensors_in(output):
                if t.requires_grad and t.grad_fn is not None:
                    made.setdefault(t.grad_fn, name)

        return hook

    entered: dict[Any, int] = {}  # grad_fn of a block's input -> the block's index
    returned: set[Any] = set()  # grad_fn of what the block before returned
    index = {id(block): i for i, block in enumerate(blocks.values())}

    def block_input(module, args):
        if args and isinstance(args[0], torch.Tensor):
            seen_at_blocks.append(args[0])
            if args[0].grad_fn is not None:
                _refuse_fed_around(args[0].grad_fn, index[id(module)])
                entered.setdefault(args[0].grad_fn, index[id(module)])
                if module is last:
                    stops.add(args[0].grad_fn)

    def _refuse_fed_around(node: Any, i: int) -> None:
        """Block i's input must come from what block i - 1 returned alone: a stage
        receives that, while the forward's loop computes the rest on stand-ins (a loop
        `x = x + block(x)` added the stage's own stand-in for the previous block's input:
        a residual MLP under pp=2 trained 4% apart from one process with no word)."""
        seen, todo = set(), [node]
        while i > 0 and todo:
            node = todo.pop()
            if node is None or node in seen or node in returned:
                continue
            seen.add(node)
            if node in entered or node in made:
                source = f"block {entered[node]}'s input" if node in entered else repr(made[node])
                raise MeshfitError(
                    f"pipeline parallel cannot split this model: the forward's loop gives "
                    f"block {i} of {container!r} an input made from {source} besides what "
                    f"block {i - 1} returned (e.g. `x = x + block(x)` in the loop), and a "
                    f"stage receives only what the block before it returned; keep the "
                    f"residual inside the block's own forward, or train with dp/fsdp/tp "
                    f"instead of pp"
                )
            todo += [next_node for next_node, _ in node.next_functions]

    def block_output(module, args, output):
        seen_at_blocks.extend(tensors_in(output))
        returned.clear()
        returned.update(t.grad_fn for t in tensors_in(output) if t.grad_fn is not None)
        if module is last:
            stops.update(returned)

    def walk(module, args, output):
        # an output that is a block's input or output as it is (output_hidden_states=True,
        # output_attentions=True) is not read by what comes after the blocks
        starts = [t for t in tensors_in(output) if not any(t is b for b in seen_at_blocks)]
        seen, todo = set(), [t.grad_fn for t in starts if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stops:
                continue
            seen.add(node)
            if node in made:
                name = made[node]
                raise MeshfitError(
                    f"pipeline parallel cannot split this model: {name!r} runs before the "
                    f"blocks, so its weights live on the first stage, but the model reads its "
                    f"output after them (on the last stage) other than through the blocks "
                    f"(meshfit's blocks: the modules of {container!r}; name another container "
                    f"of repeated blocks with blocks='...', or train with dp/fsdp/tp instead "
                    f"of pp)"
                )
            todo += [next_node for next_node, _ in node.next_functions]
        made.clear()
        stops.clear()
        seen_at_blocks.clear()
        entered.clear()
        returned.clear()

    handles = [module.register_forward_hook(prologue_output(n)) for n, module, _ in outside]
    handles += [block.register_forward_pre_hook(block_input) for block in blocks.values()]
    handles += [block.register_forward_hook(block_output) for block in blocks.values()]
    handles.append(model.register_forward_hook(walk))
    return handles


def settle_sides(
    outside: list[tuple[str, nn.Module, str]], runs: dict[str, set[str]]
) -> dict[str, str]:
    """The modules outside the blocks whose weights go to the other end than their
    registration says: those that run only on the other side of the blocks (OPT's
    final_layer_norm, registered before its layers and run after them), {name: side}.
    One that runs between the blocks, or on both sides, is refused."""
    moved = {}
    for name, _, side in outside:
        phases = runs.get(name, set())
        if not phases or phases == {side}:
            continue
        if len(phases) == 1 and "between" not in phases:
            moved[name] = next(iter(phases))
            continue
        where = "between the blocks" if "between" in phases else "before and after them"
        raise MeshfitError(
            f"pipeline parallel cannot split this model: {name!r} runs {where}, and "
            f"its weights can live on one stage only (the first, before the blocks, or "
            f"the last, after them); train with dp/fsdp/tp instead of pp"
        )
    return moved


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
                f"Pass example_inputs= (one micro-batch of inputs; fit does) so that "
                f"meshfit reads the side from one forward, or assign it {fix} the block "
                f"stack in __init__, or train with dp/fsdp/tp instead of pp"
            )

    return hook


def _side_input_check(
    name: str,
    key: str,
    found: dict[str, list[Where]] | None,
    threaded: _Threaded,
    *,
    at_cut: bool = False,
    allowed: set[Where] = frozenset(),
) -> Callable:
    """A block's input besides the hidden state that carries gradients is right under
    pp only if the block before it returned it (T5's position bias, made by the first
    block from its weights and handed on by the loop): it then crosses a cut with the
    hidden state. Any other (a skip from the embeddings, a gate registered outside the
    blocks) would be recomputed on a later stage from another stage's placeholder, its
    gradient lost: refused, before any update. The threaded ones are recorded in `found`
    (the whole model's check forward); `at_cut` (where the next stage starts), `found`
    is what the stages send, and one it does not list is refused too (no forward found
    it before training, so it would not be sent)."""

    def hook(module, args, kwargs):
        for where, value in _side_inputs(args, kwargs):
            trained = [t for t in tensors_in(value) if t.requires_grad]
            if not trained or where in allowed:
                continue
            if all(threaded.holds(t) for t in trained):
                if not at_cut:  # inside a stage, the forward's loop hands it on
                    if found is not None and where not in found.setdefault(key, []):
                        found[key].append(where)
                    continue
                if found is not None and where in found.get(key, []):
                    continue  # sent with the hidden state
                raise MeshfitError(
                    f"pipeline parallel cannot cut before block {name!r}: the block before it "
                    f"hands it {_described(where)} besides the hidden state, computed from "
                    f"trained weights, and meshfit sends such inputs across a cut only when "
                    f"one forward on example_inputs (one micro-batch of inputs) has found "
                    f"them before training: pass example_inputs= to parallelize (fit does)"
                )
            raise MeshfitError(
                f"pipeline parallel cannot split this model: block {name!r} takes "
                f"{_described(where)} besides the hidden state, and it depends on weights "
                f"outside the block (e.g. a skip connection from the embeddings, a table of "
                f"positions); "
                f"a pipeline stage receives the hidden state and what the block before "
                f"returned, not this. Compute that input inside each block, or train with "
                f"dp/fsdp/tp instead of pp"
            )
        return None

    return hook


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


def plain_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's public attributes that are plain values (numbers, text, None, and
    tuples of them): what a forward's loop may read off a block (`attention_type`)."""
    plain = (bool, int, float, str, type(None))

    def is_plain(value: Any) -> bool:
        if isinstance(value, (tuple, list)):
            return all(isinstance(v, plain) for v in value)
        return isinstance(value, plain)

    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_")
        and k not in ("training", "name", "carried", "check")
        and is_plain(v)
    }
