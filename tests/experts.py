"""Models, batches and worker runs for the expert-parallel tests (tests/test_experts.py):
transformers' Qwen3-MoE (its load-balancing loss on), Qwen2-MoE (a shared expert beside
the routed ones) and Mixtral from their own configs, and a mixture of experts written by
hand the way transformers 5 writes one (expert weights of shape (experts, ...), called
with the tokens, their top-k experts and weights), with routing even or all to one
expert; a model whose experts are a ModuleList its own loop steps through (refused)."""

from __future__ import annotations

import contextlib
import os
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from zoo import zoo_optimizer

import meshfit as mf

VOCAB, LENGTH = 32, 8


def qwen3_moe(router_loss: bool = True) -> nn.Module:
    """Its load-balancing loss on (off: its config's default, the one pp takes);
    experts_implementation="eager" (its default, torch._grouped_mm, takes no float64;
    "eager" is one of transformers' own choices)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=2 * LENGTH, moe_intermediate_size=8, num_experts=4,
            num_experts_per_tok=2, output_router_logits=router_loss, router_aux_loss_coef=0.02,
            experts_implementation="eager",
        )
    )  # fmt: skip


def qwen2_moe(router_loss: bool = True) -> nn.Module:  # a shared expert beside the routed ones
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
            shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2 * LENGTH, output_router_logits=router_loss,
            experts_implementation="eager",
        )
    )  # fmt: skip


def mixtral() -> nn.Module:
    """Its default experts (torch._grouped_mm): float32, a derived float32 tolerance."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=2 * LENGTH,
            output_router_logits=True, router_aux_loss_coef=0.02,
        )
    )  # fmt: skip


class Experts(nn.Module):
    """Expert MLPs as two weights of shape (experts, ...), the loop a user writes."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, hidden, width) * 0.3)
        self.w_out = nn.Parameter(torch.randn(experts, width, hidden) * 0.3)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                h = F.gelu(x[token] @ self.w_in[e].T) @ self.w_out[e].T
                out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, width: int, experts: int, top_k: int, skewed: bool) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = Experts(experts, width, 2 * width)
        self.top_k = top_k
        if skewed:  # every token's first choice: expert 0
            with torch.no_grad():
                self.router.bias.copy_(torch.tensor([50.0] + [0.0] * (experts - 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return self.experts(flat, index, weights).reshape(x.shape)


class OwnMoELM(nn.Module):
    """A tiny LM whose blocks are a norm and a mixture of experts, with a residual."""

    def __init__(self, experts: int = 4, top_k: int = 2, skewed: bool = False) -> None:
        super().__init__()
        width = 16
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            [
                nn.ModuleDict(
                    {"norm": nn.LayerNorm(width), "moe": MoE(width, experts, top_k, skewed)}
                )
                for _ in range(2)
            ]
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block["moe"](block["norm"](x))
        return self.head(x)


class ListMoELM(nn.Module):
    """Experts as a ModuleList stepped through by the layer's own loop (refused)."""

    def __init__(self) -> None:
        super().__init__()
        width, experts = 16, 4
        self.embed = nn.Embedding(VOCAB, width)
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(experts)])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            picked = choice == e
            out[picked] = expert(x[picked])
        return self.head(x + out)


def gpt_oss() -> nn.Module:
    """GPT-OSS: experts with a bias per expert (2-D, one row each) beside their matrices,
    a clamped SwiGLU; attention sinks; the router's top-k weights."""
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(
        GptOssConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, sliding_window=4,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * LENGTH,
            experts_implementation="eager",  # float64 (torch._grouped_mm takes none)
        )
    )  # fmt: skip


class HashMoELM(nn.Module):
    """Experts in an nn.ModuleList, each token sent to expert `id % 4` (hash routing) and
    an expert no token reaches skipped, the way a user writes one: which experts a
    rank's tokens reach depends on its share of the batch (batch_of gives rank 0's half
    no token for expert 3)."""

    def __init__(self) -> None:
        super().__init__()
        width = 16
        self.embed = nn.Embedding(VOCAB, width)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(4)
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        out = torch.zeros_like(x)
        route = ids % len(self.experts)
        for e, expert in enumerate(self.experts):
            picked = route == e
            if picked.any():
                out[picked] = expert(x[picked])
        return self.head(x + out)


BUILDS = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    # the load-balancing loss off (the configs' default), as pp takes them
    "qwen3_moe_quiet": lambda: qwen3_moe(router_loss=False),
    "qwen2_moe_quiet": lambda: qwen2_moe(router_loss=False),
    "mixtral": mixtral,
    "gpt_oss": gpt_oss,
    "own": OwnMoELM,
    "own_skewed": lambda: OwnMoELM(top_k=1, skewed=True),
    "own_3_experts": lambda: OwnMoELM(experts=3),
    "list": ListMoELM,
    "hash": HashMoELM,
}
FLOAT32 = {"mixtral"}  # kernels that take no float64


def batch_of(model: str, step: int) -> Any:
    g = torch.Generator().manual_seed(70_000 + step)
    ids = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
    if model == "hash":  # the first half (rank 0's under dp=2) reaches no expert 3
        ids[:4] -= (ids[:4] % 4 == 3).long()
    if model in ("own", "own_skewed", "own_3_experts", "list", "hash"):
        return ids, torch.randint(0, VOCAB, (8, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, -2:] = 0  # some rows right-padded, as a collator gives them
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


def ep_run(spec: dict) -> dict:
    """`spec["model"]` under `spec["plan"]` for 3 SGD steps (float64 unless its kernels
    refuse it; "grad_clip" as parallelize takes it); with "misrouted": the negative control (rank 1 sends its first token's
    first expert pair to the wrong rank)."""
    torch.manual_seed(1234)
    model = BUILDS[spec["model"]]()
    if spec["model"] not in FLOAT32:
        model = model.double()
    own = spec["model"] in ("own", "own_skewed", "own_3_experts", "list", "hash")
    with _misrouted() if spec.get("misrouted") else contextlib.nullcontext():
        engine = mf.parallelize(
            model,
            spec.get("plan"),
            loss_fn=token_loss if own else "model",
            optimizer=zoo_optimizer,
            tp_plan=spec.get("tp_plan"),
            grad_clip=spec.get("grad_clip"),
        )
        losses = [float(engine.step(batch_of(spec["model"], s))) for s in range(3)]
    return {"losses": losses, "state": engine.full_state_dict(), "placed": _placed(engine)}


def _placed(engine: Any) -> tuple[int, int]:
    """(expert elements this rank holds, expert elements of the model): the parameters
    expert parallel placed (DTensors on its "ep" mesh)."""
    from torch.distributed.tensor import DTensor

    held = whole = 0
    for p in engine.parallel_model.parameters():
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ()):
            held += p.to_local().numel()
            whole += p.numel()
    return held, whole


def many_ep_runs(specs: list[dict]) -> list[dict]:
    from workers import runs_or_refusals

    return runs_or_refusals(ep_run, specs)


@contextlib.contextmanager
def _misrouted():
    """Rank 1 sends its first (token, expert) pair to the rank after the right one."""
    from meshfit.parallel import experts

    if os.environ.get("RANK") != "1":
        yield
        return
    original = torch.div

    def wrong(a, b, *args, **kwargs):
        out = original(a, b, *args, **kwargs)
        if (
            isinstance(out, torch.Tensor)
            and out.dtype == torch.long
            and out.numel()
            and kwargs.get("rounding_mode") == "floor"
        ):
            out = out.clone()
            out[0] = (out[0] + 1) % max(int(out.max()) + 1, 2)
        return out

    with mock.patch.object(experts.torch, "div", wrong):
        yield


def ep_save_then_resume(path: str, plan: str | None, save: bool) -> list[float]:
    """Qwen3-MoE: 2 steps then a save (save=True), or a load and the third step."""
    torch.manual_seed(1234)
    engine = mf.parallelize(qwen3_moe().double(), plan, loss_fn="model", optimizer=zoo_optimizer)
    if save:
        losses = [float(engine.step(batch_of("qwen3_moe", s))) for s in range(2)]
        engine.save(path)
        engine.save_model(path + "-model")
        return losses
    engine.load(path)
    return [float(engine.step(batch_of("qwen3_moe", 2)))]


def ep_from_weights(folder: str, plan: str | None) -> list[float]:
    """Qwen3-MoE built on meta, its values read from `folder` (save_pretrained's) into
    each rank's share (`weights=`), then 3 steps."""
    with torch.device("meta"):
        model = qwen3_moe()
    engine = mf.parallelize(model, plan, loss_fn="model", optimizer=zoo_optimizer, weights=folder)
    return [float(engine.step(batch_of("qwen3_moe", s))) for s in range(3)]
