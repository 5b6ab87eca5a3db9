"""Tensor parallel: DTensor's ColwiseParallel / RowwiseParallel on each block's Linears.

The plan is derived from the model: inside every repeated block, the Linears that read
the block's input (attention's q/k/v projections, the MLP's expanding layer) become
column-parallel and the ones that write back into the residual stream (attention's
output projection, the MLP's contracting layer) row-parallel (Megatron-LM's layout:
one all-reduce after attention and one after the MLP, in forward and in backward).
Column-parallel q/k/v give each rank whole heads, so attention runs on the local heads
with no communication. For an `nn.Sequential` model, Linears separated only by
element-wise layers pair up the same way. Everything else (embeddings, norms, the LM
head) stays replicated on every tp rank.

Users can pass an explicit plan instead: ``{module name or pattern: "colwise" |
"rowwise" | a torch ParallelStyle}``.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from meshfit.errors import MeshfitError
from meshfit.parallel.blocks import find_blocks

TPPlan = dict[str, "str | ParallelStyle"]

# Last name component of Linears that read a block's input / write its output, as the
# common model families spell them (nanoGPT/meshfit, Llama/Mistral/Qwen, GPT-NeoX, BERT,
# Falcon, Megatron).
COLWISE_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                 "up", "up_proj", "gate_proj", "fc1", "c_fc", "w1", "w3", "fc_in",
                 "dense_h_to_4h"}  # fmt: skip
ROWWISE_NAMES = {"out_proj", "o_proj", "wo", "down", "down_proj", "fc2", "c_proj", "w2",
                 "fc_out", "dense_4h_to_h"}  # fmt: skip
QKV_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"}
HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
# Layers that act on each element (or each position) alone: a column-parallel output
# can pass through them to a row-parallel Linear unchanged.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
               nn.Mish, nn.Identity, nn.Dropout)  # fmt: skip
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def derive_tp_plan(model: nn.Module) -> dict[str, str]:
    """{qualified Linear name: "colwise" | "rowwise"} for `model` (see the module doc)."""
    if type(model) is nn.Sequential:
        plan = _sequential_pairs(model, prefix="")
        if plan:
            return plan
    stack = find_blocks(model)
    plan: dict[str, str] = {}
    for key, block in zip(stack.keys, stack.blocks, strict=True):
        prefix = stack.qualified(key)
        if type(block) is nn.Sequential:
            plan.update(_sequential_pairs(block, prefix=f"{prefix}."))
            continue
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf in COLWISE_NAMES:
                plan[f"{prefix}.{name}"] = "colwise"
            elif leaf in ROWWISE_NAMES:
                plan[f"{prefix}.{name}"] = "rowwise"
    styles = set(plan.values())
    if styles != {"colwise", "rowwise"}:
        raise MeshfitError(
            f"cannot derive a tensor-parallel plan for {type(model).__name__}: the blocks in "
            f"{stack.name or 'the model'!r} have no recognisable pair of input/output "
            f"Linears (looked for names such as q_proj/up/fc1 and out_proj/down/fc2). Pass "
            f"one: parallelize(..., tp_plan={{'blocks.*.mlp.fc1': 'colwise', "
            f"'blocks.*.mlp.fc2': 'rowwise'}})"
        )
    return plan


def _sequential_pairs(seq: nn.Sequential, prefix: str) -> dict[str, str]:
    """Pair Linears in a Sequential that only element-wise layers separate."""
    plan: dict[str, str] = {}
    pending: str | None = None  # a Linear waiting for its row-parallel partner
    for key, child in seq._modules.items():
        if isinstance(child, nn.Linear):
            if pending is None:
                pending = key
            else:
                plan[prefix + pending] = "colwise"
                plan[prefix + key] = "rowwise"
                pending = None
        elif not isinstance(child, ELEMENTWISE):
            pending = None
    return plan


def check_tp_plan(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Refuse up front a plan that tp does not divide: sharded Linear dimensions, and
    the head count of any attention module whose projections are split. Pattern keys
    ("blocks.*.mlp.fc1", as torch's parallelize_module takes them) are checked for every
    module they match."""
    modules = dict(model.named_modules())
    plan = {
        name: _style_name(style) for key, style in plan.items() for name in _matching(modules, key)
    }
    for name, style in plan.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear) or style is None:
            continue
        size, what = (
            (module.out_features, "output") if style == "colwise" else (module.in_features, "input")
        )
        if size % tp:
            raise MeshfitError(
                f"tp={tp} does not divide {name}'s {what} size {size} ({style}-parallel "
                f"splits it); use a tp that divides {size}"
            )
    config = getattr(model, "config", None)
    attention = dict.fromkeys(  # in plan order, so the first offender is named
        n.rsplit(".", 1)[0]
        for n, s in plan.items()
        if s == "colwise" and "." in n and n.rsplit(".", 1)[1] in QKV_NAMES
    )
    for name in attention:
        owner = modules.get(name)
        if owner is None:
            continue
        for attrs in (HEAD_ATTRS, KV_HEAD_ATTRS):
            heads = _first_attr(owner, attrs) or _first_attr(config, attrs)
            if isinstance(heads, int) and heads % tp:
                raise MeshfitError(
                    f"tp={tp} does not divide the {heads} attention heads of {name} (each "
                    f"rank must hold whole heads); use a tp that divides {heads}"
                )


def _matching(modules: dict[str, nn.Module], key: str) -> list[str]:
    """Module names `key` names: itself, or every match of a pattern whose dot-separated
    parts are matched one by one (fnmatch), as parallelize_module matches them."""
    if key in modules or "*" not in key and "?" not in key and "[" not in key:
        return [key]
    parts = key.split(".")
    return [
        name
        for name in modules
        if len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, p) for a, p in zip(name.split("."), parts, strict=True))
    ]


def _style_name(style: object) -> str | None:
    """ "colwise" / "rowwise" for a style given as text or as torch's ParallelStyle."""
    if isinstance(style, str):
        return style
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    return None


def _first_attr(obj: object, names: tuple[str, ...]) -> object:
    for attr in names:
        value = getattr(obj, attr, None)
        if value is not None:
            return value
    return None


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, tp_plan: TPPlan | None = None
) -> nn.Module:
    """Shard `model`'s Linears over `mesh` (a 1-D tp mesh) and make the replicated
    parameters identical on every tp rank."""
    tp = mesh.size()
    if tp_plan is None:
        plan = derive_tp_plan(model)
        check_tp_plan(model, plan, tp)
    else:
        plan = {name: style for name, style in tp_plan.items()}
        check_tp_plan(model, {n: s for n, s in plan.items() if isinstance(s, str)}, tp)
    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        if isinstance(style, ParallelStyle):
            styles[name] = style
        elif style in STYLES:
            styles[name] = STYLES[style]()
        else:
            raise MeshfitError(
                f"tp_plan[{name!r}] = {style!r}: use 'colwise', 'rowwise' or a "
                f"torch.distributed.tensor.parallel ParallelStyle"
            )
    # DTensor shards each weight from tp rank 0's copy (src_data_rank=0).
    parallelize_module(model, mesh, styles)
    _broadcast_replicated(model, mesh)
    return model


@torch.no_grad()
def _broadcast_replicated(model: nn.Module, mesh: DeviceMesh) -> None:
    """Copy tp rank 0's values of every unsharded parameter and buffer to the other tp
    ranks, so replicas start identical however each process initialised its model."""
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        if not isinstance(tensor, DTensor):
            dist.broadcast(tensor.data, src=src, group=group)
