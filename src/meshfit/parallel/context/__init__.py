"""Context parallel (`Plan(cp=N)`): each sequence of a rank's share cut over N ranks.

The form changes nothing in the model. It is a runner hook (`SequenceSplit`): before a
micro-batch runs, every tensor of the batch whose second dimension is the sequence is cut
to the rank's tokens (chunks.py: two chunks of 2N, for causal load balance), and while it
runs, attention is computed over the whole sequence (attention.py). What reads a
position gets the rank's own: a transformers model is given `position_ids` (its rotary
or learned position embedding reads them, and its masks for packed rows), a model that
makes its own (`torch.arange`) gets the rank's positions for it. Next-token targets are
shifted before the cut (the label at a chunk's edge belongs to the chunk that predicts
it): the model's own loss is given `shift_labels` (transformers' causal-LM loss takes
them), `mf.losses.cross_entropy(shift=True)` skips its own shift.

Gradients are averaged over dp x fsdp x cp (the Topology's loss role), so the run is one
process's: each rank's tokens' losses and gradients add up to the whole sequence's.
BatchNorm, encoder-decoders and attention dropout are refused under cp (one line each).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError
from meshfit.losses import targets_preshifted
from meshfit.parallel.context.attention import (
    DOCUMENTS_KEY,
    PADDING_KEY,
    TOKENS_KEY,
    CausalSDPA,
    SequenceState,
    hf_registry_swapped,
)
from meshfit.parallel.context.chunks import (
    check_length,
    cut,
    documents,
    local_positions,
    shifted,
)
from meshfit.trees import tensors_in


class SequenceSplit:
    """The cut of this rank's sequences, made for each micro-batch (`local`), and the
    scope its forward and loss run in (`running`)."""

    def __init__(self, model: nn.Module, topology: Any, loss_fn: Any) -> None:
        mesh = topology.cp_mesh
        self.group = mesh.get_group()
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()
        self.hugging_face = _is_hugging_face(model)
        # a transformers model given its token ids alone: they go by the name of the
        # forward's first parameter (input_ids), so that position_ids can go beside them
        self.ids_name = _first_parameter(model) if self.hugging_face else None
        self.shifts = bool(getattr(loss_fn, "shifts_targets", False))
        if hasattr(loss_fn, "sequence_cut"):  # metrics.MetricTap: pairs over tokens only
            loss_fn.sequence_cut = True
        self.state: SequenceState | None = None
        reason = why_not_cut(model)
        if reason:
            raise MeshfitError(
                f"context parallel cuts each sequence over cp={self.cp} ranks, and {reason}; "
                f"train this model without cp"
            )

    def local(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """This rank's tokens of a micro-batch (inputs and targets)."""
        length = _sequence_length(inputs)
        check_length(length, self.cp)
        device = tensors_in(inputs)[0].device
        positions = local_positions(length, self.cp, self.rank, device)
        if self.shifts and isinstance(targets, torch.Tensor):
            targets = shifted(targets)
        real = None
        if self.ids_name and isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
            # (before, the model made positions 0..local length: Gemma2's rotary departed)
            inputs = {self.ids_name: inputs}
        if self.hugging_face and isinstance(inputs, Mapping):
            real = _padding_of(inputs, length)
            inputs = self._positions_passed(dict(inputs), length, device)
            if real is not None:
                inputs[PADDING_KEY] = real
        self.state = SequenceState(self.group, positions, length, real=real)
        return cut(inputs, length, positions), cut(targets, length, positions)

    def _positions_passed(self, inputs: dict, length: int, device: torch.device) -> dict:
        rows = tensors_in(inputs)[0].shape[0]
        tokens = torch.arange(length, device=device).expand(rows, -1)
        given = inputs.get("position_ids")
        inputs["position_ids"] = tokens if given is None else given
        inputs[TOKENS_KEY] = tokens
        if given is not None:  # packed rows: attention stays within each document
            inputs[DOCUMENTS_KEY] = documents(given)
        if self.shifts and isinstance(inputs.get("labels"), torch.Tensor):
            inputs["shift_labels"] = shifted(inputs["labels"])
        return inputs

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Attention over the whole sequence, the rank's positions, targets shifted
        before the cut, while the micro-batch that `local` cut runs."""
        if self.state is None:
            raise MeshfitError("meshfit's context parallel ran a micro-batch it did not cut")
        with contextlib.ExitStack() as stack:
            if self.shifts:
                stack.enter_context(targets_preshifted())
            if self.hugging_face:
                stack.enter_context(hf_registry_swapped(self.state))
            else:
                stack.enter_context(CausalSDPA(self.state))
            stack.callback(self.state.masks.clear)  # autograd keeps what backward needs
            yield


def why_not_cut(model: nn.Module) -> str | None:
    """Why cp cannot cut this model's sequences, seen from its structure (the planner
    asks too), or None: a BatchNorm, whose statistics would cover a rank's tokens only;
    an encoder-decoder, whose decoder's cross-attention reads the encoder's whole
    sequence (before, T5 and BART were refused at the first step's probe, naming a
    module of the encoder, and the planner proposed cp for them at 4,096 tokens)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if norms:
        return f"{norms[0]!r} is a BatchNorm, whose statistics would cover the rank's tokens only"
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) is True:
        return (
            f"{type(model).__name__} is an encoder-decoder (config.is_encoder_decoder): its "
            f"decoder's cross-attention reads the encoder's whole sequence, which cp does "
            f"not gather"
        )
    return None


def _padding_of(inputs: Mapping, length: int) -> torch.Tensor | None:
    """The batch's attention_mask (rows, sequence) as bools where it pads a row, else
    None. Attention under cp builds its own mask from each token's place; transformers'
    padding must go into it, or a real token after left padding reads the padding (the
    mask transformers builds covers the rank's tokens only, and is not used)."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[1] != length:
        return None
    real = mask.bool()
    return None if bool(real.all()) else real


def _first_parameter(model: nn.Module) -> str | None:
    import inspect

    try:
        names = list(inspect.signature(type(model).forward).parameters)[1:]
    except (TypeError, ValueError):
        return None
    return names[0] if names else None


def _is_hugging_face(model: nn.Module) -> bool:
    from meshfit.weights.hf_init import is_hugging_face

    return is_hugging_face(model)


def _sequence_length(inputs: Any) -> int:
    """The sequence's length: the second dimension of the batch's first integer tensor
    of two or more dimensions (token ids)."""
    for t in tensors_in(inputs):
        if t.ndim >= 2 and not t.is_floating_point():
            return t.shape[1]
    raise MeshfitError(
        "context parallel cuts token sequences, and this batch holds no tensor of token "
        "ids (integers, batch x sequence); train this model without cp"
    )
