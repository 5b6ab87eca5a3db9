"""Models, batches and losses for tests/test_verify.py, in a module so that worker
processes can import them (mf.verify pickles them; meshfit verify imports them by name)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def small_mlp(hidden: int = 32) -> torch.nn.Module:
    """A fresh small model in float64 (verify seeds before each call)."""
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 5)
    ).double()


def small_batch(size: int = 8, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 8, generator=g, dtype=torch.float64)
    return inputs, torch.randint(0, 5, (size,), generator=g)


def loss_wrong_on_rank_1(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with its value unchanged but its gradient one part in a million too
    large on rank 1 only: a bug in one replica's share that leaves every reported loss
    of the first step as it was. Only the comparison of weights and later losses can
    see it."""
    loss = F.cross_entropy(outputs, targets)
    if os.environ.get("RANK") == "1":
        loss = loss + 1e-6 * (loss - loss.detach())
    return loss


def model_and_batch() -> tuple:
    """The `meshfit verify` contract: (model or model builder, batch, loss_fn)."""
    return small_mlp, small_batch(), F.cross_entropy


def model_and_batch_with_options() -> tuple:
    """The 4-item form: a model (not a builder), and mf.parallelize options."""
    return small_mlp(), small_batch(), lambda out, y: F.cross_entropy(out, y), {"grad_clip": 1.0}


def small_mlp_float32() -> torch.nn.Module:
    """The same small model as users build it, in float32."""
    return small_mlp().float()


class Float32Only(torch.nn.Module):
    """A model that refuses any input but float32, as a kernel without float64 does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise RuntimeError(f"expected float32 input, got {x.dtype}")
        return self.linear(x)


class Float32Norm(torch.nn.Module):
    """Gemma 2's RMSNorm as transformers writes it: input and weight cast to float32,
    the result cast back, whatever the model's dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * (1.0 + self.weight.float())).type_as(x)


def mlp_with_a_float32_norm() -> torch.nn.Module:
    """small_mlp in float64 with a Gemma-2-style norm between its layers."""
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), Float32Norm(32), torch.nn.Tanh(), torch.nn.Linear(32, 5)
    ).double()


class Float32OnlyWhenSplit(torch.nn.Module):
    """A model whose kernel refuses float64 on a path only a plan takes (Qwen3-MoE's
    grouped matmul under compile=True beside dp: one process compiles it into a kernel
    that takes float64, the plan's ranks run torch's, which does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and torch.distributed.is_initialized():
            raise RuntimeError(f"Expected mat_a to be Float32, got {x.dtype}")
        return self.linear(x)


def qwen3_and_batch() -> tuple:
    """A small transformers Qwen3 (per-head q_norm / k_norm) in float32, an SFT batch,
    and its token loss: `meshfit verify --plan tp=2` on it."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workers import build_lm, lm_loss, sft_batch

    return build_lm("qwen3", "float32"), sft_batch("qwen3", 8, 0), lm_loss("qwen3")


def qwen3_with_unsummed_norm_gradients() -> tuple:
    """qwen3_and_batch, with tp as it was before it summed the per-head norms' gradient
    parts over the ranks and without the split's backward check: the ranks' copies of
    q_norm drift apart (a bug verify must call a different run). Each process calls
    this function itself, so the patch holds in the workers."""
    from meshfit.parallel.tensor import apply, derive

    derive._partial_gradients = lambda *_: []
    apply._check_gradients = lambda *_: None
    return qwen3_and_batch()


def qwen3_moe_and_batch() -> tuple:
    """A small transformers Qwen3-MoE with its load-balancing loss on (float32: its
    grouped matmul takes no float64), a collator's batch with labels, its own loss."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zoo import FAMILIES

    family = FAMILIES["qwen3_moe_aux"]
    return family.build, family.batch(8, 0), "model"


def qwen3_moe_balanced_per_rank() -> tuple:
    """qwen3_moe_and_batch with the load-balancing statistics of each rank's own tokens,
    as meshfit formed them before issue 43 (and the coupling probe, which would refuse
    that, off): the MoE run that verify's fixed float32 tolerance called the same. Each
    process calls this itself; the workers alone are patched (one process has nothing
    to sum over)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from meshfit.coupling import batch, moe

        moe._summed = lambda *sums: sums
        batch.BatchCoupling.check_first_batch = lambda *a, **k: None
    return qwen3_moe_and_batch()


class WidthNorm(torch.nn.Module):
    """A user's own layer that normalises over the last dimension as it finds it: under
    tp, after a column-parallel Linear, it sees half the width and does not know."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:])


class Block(torch.nn.Module):
    def __init__(self, width: int, norm: bool) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.norm = WidthNorm() if norm else torch.nn.Identity()
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.norm(self.up(x))))


class BlocksMLP(torch.nn.Module):
    """Two residual MLP blocks and a head, as research code writes them."""

    def __init__(self, norm: bool = False, width: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width, norm) for _ in range(2))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def blocks_mlp() -> torch.nn.Module:
    return BlocksMLP().double()


def blocks_mlp_with_width_norm() -> torch.nn.Module:
    return BlocksMLP(norm=True).double()


# the user's tp plans: the right one, and one whose first Linear is split as if it were a
# fused pair (in two chunks) while the second expects a plain split
RIGHT_TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
WRONG_TP_PLAN = {"blocks.*.up": "colwise:2", "blocks.*.down": "rowwise"}
