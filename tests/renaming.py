"""A model that renames its tensors in its own state-dict hooks, written the way
torchtitan-style code does: q|k|v fused in one Linear for speed, saved and loaded under
the unfused names wq / wk / wv (the layout converters and other tools expect)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meshfit as mf


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self._register_state_dict_hook(Attention._unfuse)
        self._register_load_state_dict_pre_hook(Attention._fuse)

    @staticmethod
    def _unfuse(module, state, prefix, local_metadata):
        fused = state.pop(prefix + "wqkv.weight")
        for name, part in zip("qkv", fused.chunk(3), strict=True):
            state[f"{prefix}w{name}.weight"] = part
        return state

    @staticmethod
    def _fuse(state, prefix, *args):
        parts = [state.pop(f"{prefix}w{name}.weight") for name in "qkv"]
        state[prefix + "wqkv.weight"] = torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 32, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def built(dtype: torch.dtype = torch.float64) -> Transformer:
    torch.manual_seed(0)
    return Transformer().to(dtype)


def engine(plan: str | None, **options) -> mf.Engine:
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    return mf.parallelize(built(), plan, loss_fn=loss_fn, optimizer=sgd, **options)


def train_save_export(plan: str | None, checkpoint: str, export: str, steps: int = 3) -> dict:
    """Train under `plan`, save a checkpoint, export safetensors (tiny shards, so a
    module's tensors could be cut apart); the losses and the gathered state."""
    run = engine(plan, example_inputs=batch(0)[0][:2])
    losses = [float(run.step(batch(step))) for step in range(steps)]
    run.save(checkpoint)
    run.save_model(export, max_shard_size=2048)
    return {"losses": losses, "state": run.full_state_dict()}


def runs(plans: list[str], root: str) -> list[dict]:
    return [train_save_export(plan, f"{root}/{plan}-ck", f"{root}/{plan}-export") for plan in plans]
