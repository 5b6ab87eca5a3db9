"""A pipeline stage's module: the user's own forward, run over one stage's blocks.

Every stage runs the model's OWN `forward`, with the block container narrowed to the
stage's blocks: the first block's input is replaced by the activation received from the
previous stage, and the forward is left where the next stage's first block would be
called, with what it would be called with (so code the forward runs between blocks,
an activation after each block say, runs on the stage before the cut). So whatever
the forward does before the blocks (embeddings, position tables, masks) is computed on
every stage, and whatever it does after them (final norm, head) runs on the last one.
The prologue runs on later stages too, but only for the values the blocks take besides
the activation (masks, rotary tables), which must not depend on trained weights. A side
input that does and that the block before returned (T5's position bias) is sent with the
activation (the cut's check forward finds them: PipelineSplit.carried); any other that
does (a skip from the embeddings), or a module that runs on the other side of the blocks
than where it is registered, is refused at the stage's first forward rather than trained
wrongly.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import BlockStack
from meshfit.parallel.pipeline.checks import (
    Where,
    _check_the_split,
    _encloses,
    _modules_outside,
    _side_effects_undone,
    _side_input_check,
    _side_inputs,
    _Threaded,
)
from meshfit.parallel.pipeline.cut import PipelineSplit
from meshfit.trees import call_forward, map_tensors


class _StageExit(Exception):  # noqa: N818 - control flow, not an error
    """Raised by a hook after a stage's last block to leave the model's forward."""

    def __init__(self, output: Any) -> None:
        self.output = output


class StageModule(nn.Module):
    """What a PipelineStage runs: one stage's view of the user's model.

    The model is referenced, not registered, so it keeps its own parameter names. The
    modules holding the stage's parameters are registered as `units` (so a data-parallel
    wrapper over the stage module sees exactly them, and an FSDP root over it has them
    as its units); when one of those modules also holds the blocks (a parameter
    registered on the model itself) the parameters alone are, as `params`.
    """

    def __init__(
        self,
        model: nn.Module,
        stack: BlockStack,
        keys: list[str],
        *,
        is_first: bool,
        is_last: bool,
        params: list[nn.Parameter] | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager],
        outside: list[tuple[str, nn.Module, str]] = (),
        units: list[nn.Module] | None = None,
        next_key: str | None = None,
        carried: dict[str, list[Where]] | None = None,
        next_attributes: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._next_attributes = next_attributes or {}  # the next block's, for its stand-in
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_stack", stack)
        self.keys = keys
        self.is_first, self.is_last = is_first, is_last
        self.next_key = next_key  # the next stage's first block (None on the last stage)
        # Side inputs of a block that an earlier block computes (T5's position bias): they
        # cross the cut with the hidden state. {block key: where in its call}; None where
        # no forward found them (no example_inputs): a stage then refuses any it meets.
        self._carried = carried
        self.carried_in = [] if carried is None or is_first else carried.get(keys[0], [])
        self.carried_out = [] if carried is None or next_key is None else carried.get(next_key, [])
        if units is None:
            self.params = nn.ParameterList(params)
        else:
            self.units = nn.ModuleList(units)
        self._autocast = autocast
        self._outside = list(outside)  # (name, module, "before"/"after" the blocks)
        self._checked = False
        self.output_form = OutputForm()

    def forward(self, hidden_or_inputs: Any, *carried: Any, model_inputs: Any = None) -> Any:
        if _in_torch_metadata_inference():
            if not self.is_first:  # torch's stand-ins for what it would receive
                hidden_or_inputs, carried = _made_up(hidden_or_inputs), _made_up(carried)
            with _side_effects_undone(self._model):
                return self._forward(hidden_or_inputs, carried, model_inputs)
        return self._forward(hidden_or_inputs, carried, model_inputs)

    def _forward(self, hidden_or_inputs: Any, carried: tuple, model_inputs: Any) -> Any:
        model, container = self._model, self._stack.container
        # The first stage takes the batch's inputs: from `model_inputs` when the runner
        # passes them (a mapping cannot be a stage's positional input), else positional.
        first_inputs = model_inputs if model_inputs is not None else hidden_or_inputs
        inputs = first_inputs if self.is_first else model_inputs
        blocks = {k: container._modules[k] for k in self.keys}
        everything = container._modules
        handles = []
        if not self.is_first:
            hidden_or_inputs = map_tensors(hidden_or_inputs, _with_contiguous_gradient)
            carried = tuple(map_tensors(carried, _with_contiguous_gradient))
            handles.append(
                blocks[self.keys[0]].register_forward_pre_hook(
                    _replace_first_args(
                        hidden_or_inputs, dict(zip(self.carried_in, carried, strict=True))
                    ),
                    with_kwargs=True,
                )
            )
        checking = not self._checked  # the first forward only: free afterwards
        threaded = _Threaded()
        if checking:
            self._checked = True
            handles += _check_the_split(
                blocks, self._stack, self._outside, threaded=threaded, given=set(self.carried_in)
            )
        if not self.is_last:
            # In the next block's place: the loop calls it with the next stage's input.
            name = self._stack.qualified(self.next_key)
            check = (
                _side_input_check(name, self.next_key, self._carried, threaded, at_cut=True)
                if checking
                else None
            )
            attributes = self._next_attributes
            blocks[self.next_key] = _NextStageInput(name, self.carried_out, check, attributes)
        # The checks read requires_grad, so they need autograd on, also in an evaluation.
        untracked = checking and not torch.is_grad_enabled()
        container._modules = blocks  # the forward's loop sees only this stage's blocks
        try:
            with self._autocast(), torch.enable_grad() if untracked else contextlib.nullcontext():
                output = call_forward(model, inputs)
        except _StageExit as leave:
            output = _sendable(leave.output)
        finally:
            container._modules = everything
            for h in handles:
                h.remove()
        if self.is_last:
            output = self.output_form.flatten(output)
        return map_tensors(output, torch.Tensor.detach) if untracked else output


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: a later stage's
    input gradient is what it sends back, and torch's backward metadata (2.13) takes its
    strides for the earlier stage's receive buffer. ConvNeXt's first layer on a stage
    (a conv) gave a channels-last gradient, and the earlier stage's receive failed with
    "input tensor has to be contiguous"."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _with_contiguous_gradient(t: torch.Tensor) -> torch.Tensor:
    return _ContiguousGradient.apply(t) if t.requires_grad else t


def _sendable(output: Any) -> Any:
    """What the next stage receives: torch sends contiguous tensors only (a channels-last
    norm's or a transposed output failed in the send, "input tensor has to be
    contiguous")."""
    return map_tensors(output, torch.Tensor.contiguous)


# What torch's PipelineStage calls its first forward in (2.13: `_forward_metadata_inference`;
# earlier releases: `_shape_inference`): a forward on the first micro-batch (on later
# stages, on uninitialised tensors) to learn the shapes that travel between stages.
# (the backward's calls the loss on the last stage, on outputs of made-up inputs)
_METADATA_INFERENCE = {
    "_forward_metadata_inference",
    "_backward_metadata_inference",
    "_shape_inference",
}


def _made_up(tree: Any) -> Any:
    """Torch's metadata inference gives a later stage `torch.empty` tensors for what it
    would receive: uninitialised memory, at times NaN, and a model that checks its
    activations failed in its own code (I-BERT's QuantAct asserts "NaN detected when
    computing min/max of the activation": I-BERT under pp=2 raised transformers'
    AssertionError). Activations drawn from a normal distribution (a generator of its
    own: the global random state untouched) and integers at zero have the shapes and
    dtypes the inference is after, and values a model computes on (zeros would not do:
    a norm without an epsilon divides by them)."""
    g = torch.Generator().manual_seed(0)

    def made_up(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):  # tp x pp: torch's own, as it made it
            return t
        if not t.is_floating_point():
            return torch.zeros_like(t)
        drawn = torch.randn(t.shape, generator=g).to(dtype=t.dtype, device=t.device)
        return drawn.requires_grad_(t.requires_grad)

    return map_tensors(tree, made_up)


def _in_torch_metadata_inference() -> bool:
    frame = sys._getframe(2)
    for _ in range(8):  # the stage's method calls the module a few frames up
        if frame is None:
            return False
        if frame.f_code.co_name in _METADATA_INFERENCE:
            return True
        frame = frame.f_back
    return False


class OutputForm:
    """The model's own output object (a Hugging Face ModelOutput, a dict, a tuple) made
    into what a PipelineStage can return, a tuple of tensors, and back for loss_fn: the
    last stage's output never travels, so it goes to the loss on the same rank in the
    model's own form. Leaves that are not tensors (a KV cache object) become None; a
    0-d tensor (the model's own loss) travels as shape (1,), since the schedule
    concatenates the micro-batches' outputs after a step."""

    def __init__(self) -> None:
        self.spec: TreeSpec | None = None
        self.kept: list[bool] = []  # which leaves were tensors
        self.scalars: list[bool] = []  # which of the kept ones were 0-d

    def flatten(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.dim() > 0:
            self.spec = None
            return output
        leaves, self.spec = tree_flatten(output)
        self.kept = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.scalars = [t.dim() == 0 for t in tensors]
        return tuple(t.reshape(1) if t.dim() == 0 else t for t in tensors)

    def restore(self, flat: Any) -> Any:
        """The output object from what `flatten` returned (unchanged for a tensor)."""
        if self.spec is None:
            return flat
        given = flat if isinstance(flat, (tuple, list)) else (flat,)
        tensors = iter(
            t.reshape(()) if scalar else t for t, scalar in zip(given, self.scalars, strict=True)
        )
        leaves = [next(tensors) if kept else None for kept in self.kept]
        return tree_unflatten(leaves, self.spec)


def _replace_first_args(hidden: torch.Tensor, carried: dict[Where, torch.Tensor]) -> Callable:
    """The stage's first block gets the received hidden state, and the side inputs an
    earlier stage's blocks computed, in place of what this stage's forward has there."""

    def hook(module, args, kwargs):
        if not args:
            raise MeshfitError(
                f"pipeline parallel needs the blocks to take the hidden state as their "
                f"first positional argument; {type(module).__name__} got keywords only"
            )
        args, kwargs = [hidden, *args[1:]], dict(kwargs)
        for (kind, at), value in carried.items():
            if kind == "arg":
                args[at] = value
            else:
                kwargs[at] = value
        return tuple(args), kwargs

    return hook


class _NextStageInput(nn.Module):
    """Stands where the next stage's first block is in the narrowed container: the
    forward's loop calls it with that block's input, which is what this stage sends.
    Leaving after the stage's last block instead would lose what the loop does between
    two blocks (measured: a loop applying tanh after each block trained another run).
    It carries that block's plain attributes (`attributes`), which a loop may read
    before calling it: ModernBERT picks each layer's mask by `layer.attention_type`
    (before, an AttributeError on the first stage, told as the batch's fault)."""

    def __init__(
        self,
        name: str,
        carried: list[Where],
        check: Callable | None,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        for attribute, value in (attributes or {}).items():
            setattr(self, attribute, value)
        self.name, self.carried, self.check = name, carried, check

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not args:
            raise MeshfitError(
                "pipeline parallel needs the blocks to take the hidden state as their "
                "first positional argument; the model's forward passes keywords only"
            )
        if self.check is not None:  # what the next block gets besides the hidden state
            self.check(self, args, kwargs)
        if not self.carried:
            raise _StageExit(args[0])
        sides = dict(_side_inputs(args, kwargs))
        raise _StageExit((args[0], *(sides[where] for where in self.carried)))


def build_stage_module(
    model: nn.Module,
    split: PipelineSplit,
    stage: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> StageModule:
    """Stage `stage`'s module. Build it after sharding: sharding replaces parameter
    objects, and a stage module that lists parameters must list the new ones."""
    owners = split.owners(stage)
    encloses_blocks = any(_encloses(m, split.stack.container) for m in owners)
    return StageModule(
        model,
        split.stack,
        split.stage_keys[stage],
        is_first=stage == 0,
        is_last=stage == split.num_stages - 1,
        params=split.stage_parameters(stage) if encloses_blocks else None,
        units=None if encloses_blocks else owners,
        autocast=autocast,
        outside=_modules_outside(model, split.stack, split.head, split.tail),
        next_key=None if stage == split.num_stages - 1 else split.stage_keys[stage + 1][0],
        carried=split.carried,
        next_attributes=None
        if stage == split.num_stages - 1
        else split.block_attributes.get(split.stage_keys[stage + 1][0]),
    )
