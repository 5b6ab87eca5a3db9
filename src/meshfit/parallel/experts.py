"""Expert parallel (`Plan(ep=N)`): every mixture-of-experts layer's experts spread whole
over the N ranks of an ep group, each token sent to the ranks that hold its experts and
its results sent back (all-to-all), dropless: no capacity, no token dropped, so the
numbers are one process's.

Found, not named. An experts module is one whose own parameters all lead with one size
E (the experts), of three or more dimensions (the experts' matrices) or two (their
biases, as GPT-OSS's: one row per expert), at least one a matrix, called as
`experts(hidden (tokens, width), top_k_index (tokens, k), top_k_weights (tokens, k))`:
transformers 5's fused experts (Mixtral, Qwen2-MoE with its shared expert beside them,
Qwen3-MoE, OLMoE, ...: `@use_experts_implementation`), and a user's own written the same
way. Experts kept as a `ModuleList` of expert MLPs, stepped through by the layer's own
loop, cannot be placed (the loop, not a call meshfit sees, decides which expert runs),
and are refused in one line naming the module.

Placed: rank r of the ep group keeps experts [r E/N, (r+1) E/N) of every layer, as a
DTensor sharded on its first dimension over the ep mesh (so checkpoints, full_state_dict,
DCP resharding and gradient clipping see one tensor of E experts, the one-process layout).
The module's forward becomes: route (the router ran already, in the layer's code), send
each (token, expert) pair to the expert's rank, run the module's own expert computation
there on this rank's experts (its code, with the local experts as its parameters and
each pair's weight 1), send the outputs back, weight them by the router's scores and sum
per token in expert order, as the module's own loop does.

Gradients: the experts' parameters are left to neither DDP nor FSDP2 (each wraps one
group; the experts need another). A rank's expert gradient already holds what every rank
of its ep group sent it; the ranks that hold the same experts (the expert-data-parallel
group: the loss ranks ep leaves) sum theirs, and the sum is divided by the loss ranks'
count, as DDP/FSDP2 divide the others'. One all-reduce per expert tensor and step, after
the last micro-batch's backward, by `ExpertParallel.reduce_gradients` (a hand-written
reduction of gradients; the reason is the group, above).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshfit.errors import MeshfitError
from meshfit.parallel.collectives import all_to_all


@dataclass
class ExpertLayer:
    """One experts module: where it is, its expert tensors, how many experts."""

    name: str
    module: nn.Module
    tensors: tuple[str, ...]  # its own parameters, each (experts, ...)
    experts: int


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every module whose own parameters all lead with one size E >= 2, each of two or
    more dimensions and one of three or more (matrices per expert, and their biases),
    and whose forward takes (hidden, top_k_index, top_k_weights)."""
    found = []
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own or any(p.ndim < 2 for p in own.values()):
            continue
        if not any(p.ndim >= 3 for p in own.values()):
            continue
        sizes = {p.shape[0] for p in own.values()}
        if len(sizes) != 1 or sizes == {1}:
            continue
        if len(_positional(module)) < 3:
            continue
        found.append(ExpertLayer(name, module, tuple(own), sizes.pop()))
    return found


def _positional(module: nn.Module) -> list[str]:
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.kind in kinds][1:]


def unplaceable_experts(model: nn.Module) -> str | None:
    """The first module holding its experts as a ModuleList of two or more modules of one
    class beside a router whose outputs count them (a Linear with that many outputs)."""
    for name, module in model.named_modules():
        lists = [
            (child_name, child)
            for child_name, child in module.named_children()
            if isinstance(child, nn.ModuleList) and len(child) >= 2
        ]
        for child_name, experts in lists:
            kinds = {type(m) for m in experts}
            if len(kinds) != 1:
                continue
            routers = [
                m
                for m in module.modules()
                if isinstance(m, nn.Linear) and m.out_features == len(experts)
            ]
            if routers:
                return f"{name}.{child_name}" if name else child_name
    return None


class ExpertParallel:
    """The experts of every layer placed over the ep group (`place`), the forward that
    sends tokens to them, and the gradients' reduction (`reduce_gradients`)."""

    def __init__(self, model: nn.Module, topology: Any) -> None:
        self.mesh = topology.ep_mesh
        self.group = self.mesh.get_group()
        self.ep, self.rank = self.mesh.size(), self.mesh.get_local_rank()
        self.replicas = topology.expert_replica_group  # None: no other rank holds them
        self.divisor = topology.grad_average_size
        self.layers = find_expert_layers(model)
        if not self.layers:
            where = unplaceable_experts(model)
            raise MeshfitError(
                (
                    f"ep={self.ep} places whole experts on ranks, and {where!r} holds its "
                    f"experts as a list of modules that its own loop steps through, which "
                    f"meshfit cannot send tokens into"
                    if where
                    else f"ep={self.ep} places the experts of a mixture of experts on "
                    f"ranks, and {type(model).__name__} has no experts module (parameters "
                    f"of shape (experts, ...) called with the tokens, their top-k experts "
                    f"and weights)"
                )
                + "; train it with a plan without ep (tp splits every expert; dp/fsdp "
                "replicate or shard them)"
            )
        for layer in self.layers:
            if layer.experts % self.ep:
                raise MeshfitError(
                    f"ep={self.ep} spreads whole experts over {self.ep} ranks, and "
                    f"{layer.name} has {layer.experts}: use an ep that divides "
                    f"{layer.experts}"
                )
        self.parameters: list[nn.Parameter] = []
        for layer in self.layers:
            self._place(layer)

    def _place(self, layer: ExpertLayer) -> None:
        module, share = layer.module, layer.experts // self.ep
        first = self.rank * share
        for name in layer.tensors:
            full = getattr(module, name)
            if isinstance(full, DTensor):  # a tp_plan of the user's split it
                raise MeshfitError(
                    f"ep={self.ep} places the experts of {layer.name} whole, and tp_plan "
                    f"splits its {name!r}; leave the experts out of tp_plan (meshfit's own "
                    f"derived plan does beside ep)"
                )
            local = full.detach()[first : first + share].clone()
            placed = nn.Parameter(
                DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False),
                requires_grad=full.requires_grad,
            )
            setattr(module, name, placed)
            self.parameters.append(placed)
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = share  # the module's own loop counts its local experts
        original = type(module).forward
        module.forward = _dispatching_forward(module, layer, original, self, first, share)

    def reduce_gradients(self) -> None:
        """Each expert gradient summed over the ranks holding the same experts and
        divided by the loss ranks' count (one process's gradient), after the step's last
        backward. Every rank calls it: a rank that routed no token to an expert still
        contributes its zeros."""
        for p in self.parameters:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = DTensor.from_local(
                    torch.zeros_like(p.to_local()), self.mesh, [Shard(0)], run_check=False
                )
            local = p.grad.to_local()
            if self.replicas is not None:
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.replicas)
            if self.divisor > 1:
                local.div_(self.divisor)


def _dispatching_forward(
    module: nn.Module, layer: ExpertLayer, original: Any, ep: ExpertParallel, first: int, share: int
) -> Any:
    def forward(
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *rest,
        **kwargs,
    ):
        if (
            hidden.ndim != 2
            or top_k_index.shape != top_k_weights.shape
            or top_k_index.is_floating_point()
        ):
            raise MeshfitError(
                f"ep={ep.ep}: {layer.name} ({type(module).__name__}) was called with "
                f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, "
                f"{tuple(top_k_weights.shape)}, not (tokens, width), (tokens, k), "
                f"(tokens, k) as an experts module is; train it with a plan without ep"
            )
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        # pairs in expert order (stable: within an expert, token order), as the module's
        # own loop visits them: the per-token sums add in the same order
        order = torch.argsort(experts, stable=True)
        sorted_experts = experts[order]
        token_of = order // k
        to_rank = torch.div(sorted_experts, share, rounding_mode="floor")
        send_counts = torch.bincount(to_rank, minlength=ep.ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        arrived = all_to_all(hidden[token_of], recv, send, ep.group)
        local_expert = torch.empty(sum(recv), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(
            local_expert, sorted_experts - to_rank * share, recv, send, group=ep.group
        )
        ones = torch.ones(local_expert.shape[0], 1, dtype=top_k_weights.dtype, device=hidden.device)
        with _local_experts(module, layer):
            done = original(module, arrived, local_expert[:, None], ones, *rest, **kwargs)
        if arrived.requires_grad and not done.requires_grad:
            # a rank that received no token: its experts' output is a constant, and its
            # backward would skip both all-to-alls while its peers wait in them (measured:
            # every token routed to expert 0 hung the first backward). An empty sum ties
            # them into the graph, adding exactly nothing.
            done = done + arrived[:0].sum()
        back = all_to_all(done, send, recv, ep.group)
        weights = top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden)
        return out.index_add(0, token_of, (back * weights).to(out.dtype))

    return forward


@contextlib.contextmanager
def _local_experts(module: nn.Module, layer: ExpertLayer) -> Iterator[None]:
    """The module's expert parameters as this rank's local tensors while its own code
    runs (the gradient flows back to the DTensor parameters through to_local)."""
    placed = {name: module._parameters[name] for name in layer.tensors}
    try:
        for name, p in placed.items():
            module._parameters[name] = p.to_local()  # type: ignore[assignment]
        yield
    finally:
        for name, p in placed.items():
            module._parameters[name] = p


def routed_experts(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(the module that calls them, the experts module) for each mixture whose experts a
    rank's tokens may all miss at a step: a module named after its experts (`experts`,
    `expert`; not a shared expert, which every token reaches) with parameters outside
    the fused expert tensors `find_expert_layers` finds (a fused tensor gets a gradient
    whenever any of its experts is reached): an nn.ModuleList of experts, or LongCat-
    Flash's, whose zero-computation experts can take all of a rank's tokens."""
    fused = {id(p) for layer in find_expert_layers(model) for p in layer.module.parameters()}
    modules = dict(model.named_modules())
    found = []
    for name, module in modules.items():
        parent, _, last = name.rpartition(".")
        if "expert" not in last.lower() or "shared" in last.lower():
            continue
        if any(p.requires_grad and id(p) not in fused for p in module.parameters()):
            found.append((modules[parent], module))
    return found


def reach_every_expert(
    model: nn.Module, routed: list[tuple[nn.Module, nn.Module]] | None = None
) -> list[Any]:
    """Hooks that put every parameter of the routed experts (`routed_experts`) in each
    forward's graph, times zero: the gradient of an expert no token of this rank reached
    is then zeros, not None. Without it the ranks reduced different sets of gradients:
    LongCat-Flash under dp=2 and fsdp=2 aborted gloo ("Received data size doesn't match
    expected size": one rank reduced its experts' gradients, the other had none), as a
    mixture of your own with an nn.ModuleList of experts would. One element of each
    parameter is read (its gradient is still the whole tensor's zeros), on the module
    that calls the experts, which runs whichever experts are reached. `routed`:
    `routed_experts(model)` where the caller has it already."""
    handles = []
    for caller, experts in routed if routed is not None else routed_experts(model):
        # the parameters as the forward sees them (FSDP2 swaps in the unsharded ones)
        def touch(module: nn.Module, args: Any, output: Any, experts: nn.Module = experts) -> Any:
            first = output[0] if isinstance(output, tuple) else output
            if not isinstance(first, torch.Tensor) or not first.is_floating_point():
                return output
            params = [p for p in experts.parameters() if p.requires_grad]
            zero = sum(_one_element(p) for p in params) * 0.0
            touched = first + zero.to(first.dtype)
            return (touched, *output[1:]) if isinstance(output, tuple) else touched

        handles.append(caller.register_forward_hook(touch))
    return handles


def _one_element(p: torch.Tensor) -> torch.Tensor:
    """One element of a parameter, read without a collective (a tp shard: its own)."""
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.reshape(-1)[0]
