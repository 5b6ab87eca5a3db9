"""Mixtures of experts: their load-balancing loss over the global batch.

Hugging Face's MoE language models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and about
thirty more) add `router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`
to their loss when `output_router_logits` is on: Switch Transformer's
E * sum_i f_i * P_i, with f_i the share of top-k assignments that went to expert i and
P_i its mean router probability, both over every token of the batch and every layer. A
rank that forms it from its own tokens trains another run (measured: 3.3e-5 apart at
every step under dp=2 on a tiny Qwen3-MoE). Inside meshfit's step the model's module
calls meshfit's version instead: the same sums as transformers' function, then summed
over the ranks a loss is formed over (`scope.sum_over`: those that split the batch, and
context parallel's, which split its sequences), so the loss is the one-process value
and its gradient too. Outside a step (prediction, user code) the library's own
function runs.

The (sum, count) normalisation of a model's own token loss (losses.ModelOwnLoss: the
model sums its token losses and meshfit divides by the global count) would divide the
load-balancing term by the token count too; the step's `Scope.aux_scale` multiplies it
by (global count / loss ranks / micro-batches) first, which leaves it as the model wrote it:
the token mean plus the coefficient times the load-balancing loss.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from meshfit.coupling.scope import current, sum_over
from meshfit.errors import MeshfitError

FUNCTION = "load_balancing_loss_func"
_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


@dataclass(frozen=True)
class LoadBalancing:
    """The library modules whose `load_balancing_loss_func` the model's classes call."""

    modules: tuple[ModuleType, ...]

    @property
    def found(self) -> bool:
        return bool(self.modules)

    @contextlib.contextmanager
    def global_in_steps(self) -> Iterator[None]:
        """meshfit's function in the modules' namespace while the block runs."""
        saved = [(m, getattr(m, FUNCTION)) for m in self.modules]
        for module, original in saved:
            setattr(module, FUNCTION, _global_version(original, module.__name__))
        try:
            yield
        finally:
            for module, original in saved:
                setattr(module, FUNCTION, original)

    @contextlib.contextmanager
    def left_out(self) -> Iterator[None]:
        """The load-balancing loss as zero while the block runs: context parallel's probe
        compares the model's reading of a sequence, whole and cut, without it (it is
        meshfit's own sum over the ranks, tested apart; a rank's window alone would form
        it from other tokens than the step does)."""
        saved = [(m, getattr(m, FUNCTION)) for m in self.modules]

        def zero(gate_logits: Any, *args: Any, **kwargs: Any) -> Any:
            if gate_logits is None or not isinstance(gate_logits, tuple) or not gate_logits:
                return 0
            return gate_logits[0].new_zeros(())

        for module, _ in saved:
            setattr(module, FUNCTION, zero)
        try:
            yield
        finally:
            for module, original in saved:
                setattr(module, FUNCTION, original)


def find_load_balancing(model: nn.Module) -> LoadBalancing:
    """The modules of the model's classes that define Hugging Face's load-balancing loss
    with its usual signature (found by name and signature, not by family)."""
    found: dict[str, ModuleType] = {}
    for sub in model.modules():
        for cls in type(sub).__mro__:
            module = sys.modules.get(cls.__module__)
            function = getattr(module, FUNCTION, None)
            if module is None or module.__name__ in found or not callable(function):
                continue
            if _has_usual_signature(function):
                found[module.__name__] = module
    return LoadBalancing(tuple(found.values()))


def _has_usual_signature(function: Callable[..., Any]) -> bool:
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return names[: len(_PARAMETERS)] == _PARAMETERS


def _global_version(original: Callable[..., Any], where: str) -> Callable[..., Any]:
    def load_balancing_loss_func(
        gate_logits: Any,
        num_experts: int | None = None,
        top_k: int = 2,
        attention_mask: torch.Tensor | None = None,
        *rest: Any,
        **kwargs: Any,
    ) -> Any:
        scope = current()
        if scope is None or rest or kwargs:  # outside a step, or a signature we do not know
            return original(gate_logits, num_experts, top_k, attention_mask, *rest, **kwargs)
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0  # as transformers' function: no router logits, no loss
        if scope.pipeline:  # refused before the step where the batch or config says so
            raise MeshfitError(pipeline_refusal(where))
        tokens, probs, rows = routing_sums(gate_logits, num_experts, top_k, attention_mask)
        tokens, probs, rows = _summed(tokens, probs, rows)
        tokens_per_expert = tokens / rows
        router_prob_per_expert = probs / rows
        overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
        return overall_loss * num_experts * scope.aux_scale

    load_balancing_loss_func.__wrapped__ = original  # type: ignore[attr-defined]
    return load_balancing_loss_func


def refused_under_pipeline(model: nn.Module) -> str | None:
    """Why a pipeline plan is refused for `model` (a load-balancing loss on in its
    config), or None: what BatchCoupling refuses at build, for the planner."""
    found = find_load_balancing(model)
    config = getattr(model, "config", None)
    if found.found and getattr(config, "output_router_logits", False):
        return pipeline_refusal(found.modules[0].__name__)
    return None


def pipeline_refusal(where: str) -> str:
    return (
        f"the model's load-balancing loss ({where}.{FUNCTION}) sums the router statistics "
        f"of every layer, and a pipeline stage holds only its own layers: train it with dp, "
        f"fsdp, ep (the experts placed) or tp (the experts split), or turn the loss off "
        f"under pp "
        f"(output_router_logits=False in the config and the batch)"
    )


def routing_sums(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k assignments per expert, router probability per expert, rows), summed over
    the layers and this rank's tokens, with the operations of transformers' function (so
    one process computes bit for bit what the library does)."""
    device = gate_logits[0].device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows: Any = 0.0
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        if attention_mask is None:
            tokens = tokens + torch.histc(
                selected.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts
            )
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            tokens = tokens + torch.zeros(
                num_experts, dtype=torch.float32, device=device
            ).scatter_add_(0, selected.reshape(-1), flat_mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    rows = torch.as_tensor(rows, dtype=torch.float32, device=device)
    return tokens, probs, rows


def _summed(
    tokens: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three sums over the ranks that split the batch: the counts without a gradient
    (they have none), the probabilities with one."""
    what = "the load-balancing loss"
    counts = sum_over(torch.cat([tokens.detach(), rows.detach().reshape(1)]), what)
    return counts[:-1], sum_over(probs, what), counts[-1]
