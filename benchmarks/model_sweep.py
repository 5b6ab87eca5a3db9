"""Every causal LM in transformers, from its own config made tiny, under each plan against
one process: which train the one-process run, which are refused (in one line), and which
do neither. A finder of silent wrong runs, not a timer.

Each model type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from its
config with small sizes (32 wide, 2 layers, 4 heads, 4 experts, a vocabulary of 32;
`EXTRA` has the fields some types need on top; the head tied to the embedding where
the type's config ties it), dropout off, and trained for 3 SGD
steps on a collator's batches (right-padded ids with their mask, -100 on the prompt and
the padding) with the token-weighted causal loss: first in one process (float64, or
float32 where its kernels take no float64), then under each plan, all types in one
launch of workers per plan. A type whose config cannot be made small, or whose model is
over `--max-params` as built, has no reference and is listed with why.

    python benchmarks/model_sweep.py [--plans "tp=2;pp=2;dp=2;fsdp=2"] [--types llama,gpt2]
    python benchmarks/model_sweep.py --plans "ep=2" --types mixtral,qwen3_moe
    python benchmarks/model_sweep.py --quick    # two types, dp=2 and pp=2
    python benchmarks/model_sweep.py --task masked   # every masked LM, plain cross-entropy

A "different" row is not yet a bug: a model that draws random numbers in training
(residual dropout a config names otherwise, PhiMoE's Gumbel routing) cannot match, and
one that computes in float32 inside a float64 model (Gemma's norms, Mamba's scan) is
float32's rounding apart; rerun such a type with `--dtype float32` (1e-5 is the bar).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings

import torch

import meshfit as mf
from meshfit.verification.run import weight_differences

VOCAB, LENGTH, BATCH, STEPS = 32, 12, 8, 3
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=48, head_dim=8, max_position_embeddings=64,
    hidden_dropout=0.0, attention_dropout=0.0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# set after the config is made, where it has the field: a few experts
EXPERTS = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16,
)  # fmt: skip
_MLA = dict(
    q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    head_dim=4, num_key_value_heads=4, first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip
# fields some types need besides SMALL (multi-head latent attention's ranks, rotary dims)
EXTRA: dict[str, dict] = {
    **{
        t: _MLA
        for t in (
            "deepseek_v2", "deepseek_v3", "deepseek_v32", "minicpm3", "glm4_moe_lite",
            "glm_moe_dsa", "longcat_flash", "youtu", "axk1", "axk2", "hy_v4", "sarvam_mla",
        )
    },
    "codegen": dict(rotary_dim=4),
    "gptj": dict(rotary_dim=4),
    "dory": dict(num_hidden_layers=6, n_input_layers=2, n_output_layers=2),
    "seed_oss": dict(residual_dropout=0.0),
}  # fmt: skip
QUICK_TYPES, QUICK_PLANS = ("llama", "gpt2"), ("dp=2", "pp=2")


def build(model_type: str, task: str = "causal") -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(1234)
    config = AutoConfig.for_model(model_type, **{**SMALL, **EXTRA.get(model_type, {})})
    for key, value in EXPERTS.items():
        if hasattr(config, key):
            setattr(config, key, value)
    auto = AutoModelForMaskedLM if task == "masked" else AutoModelForCausalLM
    return auto.from_config(config)


def batch(step: int, task: str = "causal") -> tuple[dict, torch.Tensor]:
    """A collator's batch: right-padded ids and mask, -100 on the prompt and padding
    (masked: -100 but on about 15% of the real tokens, each replaced by a mask id, as
    DataCollatorForLanguageModeling does)."""
    masked = task == "masked"
    g = torch.Generator().manual_seed((40_000 if masked else 30_000) + step)
    ids = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i in range(BATCH):
        n = int(torch.randint(4, LENGTH + 1, (), generator=g))
        ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, :n] = 1
        if masked:
            picked = torch.randperm(n, generator=g)[: max(1, n * 15 // 100)]
            labels[i, picked] = ids[i, picked]
            ids[i, picked] = 3  # the mask token's id in this small vocabulary
        else:
            prompt = int(torch.randint(1, n - 1, (), generator=g))
            labels[i, prompt:n] = ids[i, prompt:n]
    return {"input_ids": ids, "attention_mask": mask}, labels


def train(spec: dict) -> dict:
    """3 SGD steps of spec["type"] under spec["plan"] (None: one process): its losses
    and final weights, {"refused": meshfit's line} or {"error": what else was raised}."""
    torch.set_num_threads(1)
    try:
        task = spec.get("task", "causal")
        with torch.device("meta"):
            size = sum(p.numel() for p in build(spec["type"], task).parameters())
        if size > spec["max_params"]:
            return {"error": f"{size:,} parameters as built (over --max-params)"}
        dtype = getattr(torch, spec["dtype"])
        model = build(spec["type"], task).to(dtype)
        first = batch(0, task)[0]
        engine = mf.parallelize(
            model,
            spec["plan"],
            loss_fn=mf.losses.cross_entropy(shift=task == "causal"),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            example_inputs=mf.trees.slice_rows(first, 0, 2),
        )
        losses = [float(engine.step(batch(s, task))) for s in range(STEPS)]
        return {"losses": losses, "state": engine.full_state_dict()}
    except mf.MeshfitError as refusal:
        return {"refused": str(refusal)}
    except Exception as error:  # noqa: BLE001 - a sweep records every failure and goes on
        last = traceback.format_exc().strip().splitlines()[-1]
        return {"error": f"{type(error).__name__}: {error}"[:400], "last": last[:400]}


def train_each(specs: list[dict]) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [train(spec) for spec in specs]


def reference(model_type: str, dtype: str | None, max_params: int, task: str) -> dict:
    """The one-process run, float64 first (float32 where its kernels refuse float64)."""
    for tried in (dtype,) if dtype else ("float64", "float32"):
        spec = {"type": model_type, "plan": None, "dtype": tried, "max_params": max_params}
        spec["task"] = task
        got = train_each([spec])[0]
        if "losses" in got or "parameters as built" in got.get("error", ""):
            break
    return {**got, "dtype": tried}


def workers(plan: str) -> int:
    """The processes a plan takes (dp unresolved: one replica, ep of them under ep)."""
    parsed = mf.Plan.parse(plan)
    return parsed.world_size or parsed.processes_per_replica * (getattr(parsed, "ep", 1) or 1)


def verdict(got: dict, ref: dict) -> dict:
    if "losses" not in got:
        kind = "refused" if "refused" in got else "error"
        return {"verdict": kind, "why": (got.get("refused") or got.get("error", ""))[:300]}
    rtol = 1e-5 if ref["dtype"] == "float32" else 1e-9
    losses = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    weights = max(weight_differences(got["state"], ref["state"]).values())
    same = losses <= rtol and weights <= rtol
    return {"verdict": "same" if same else "different", "losses": losses, "weights": weights}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="tp=2;pp=2;dp=2;fsdp=2", help="';'-separated")
    parser.add_argument("--types", default="", help="','-separated (default: every one)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None)
    parser.add_argument("--max-params", type=int, default=3_000_000)
    parser.add_argument("--task", choices=("causal", "masked"), default="causal")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from transformers.models.auto import modeling_auto

    names = (
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
        if args.task == "masked"
        else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    types = args.types.split(",") if args.types else sorted(names)
    plans = args.plans.split(";")
    if args.quick:
        types, plans = list(QUICK_TYPES), list(QUICK_PLANS)
    torch.set_num_threads(1)
    start = time.time()
    refs = {t: reference(t, args.dtype, args.max_params, args.task) for t in types}
    built = [t for t in types if "losses" in refs[t]]
    print(f"one process: {len(built)} of {len(types)} types trained ({time.time() - start:.0f} s)")
    rows = [
        {"type": t, "plan": None, "verdict": "no reference", "why": refs[t].get("error", "")[:300]}
        for t in types
        if t not in built
    ]
    for plan in plans:
        specs = [
            {"type": t, "plan": plan, "dtype": refs[t]["dtype"], "max_params": args.max_params}
            | {"task": args.task}
            for t in built
        ]
        results = mf.launch(train_each, nproc=workers(plan), args=(specs,))
        for spec, got in zip(specs, results, strict=True):
            row = {"type": spec["type"], "plan": plan, "dtype": spec["dtype"]}
            row.update(verdict(got, refs[spec["type"]]))
            rows.append(row)
            numbers = (
                f"losses {row['losses']:.1e} weights {row['weights']:.1e}"
                if "losses" in row
                else row["why"][:160]
            )
            print(f"{spec['type']:24s} {plan:10s} {row['verdict']:9s} {numbers}", flush=True)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    print("verdicts:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.out:
        with open(args.out, "w") as f:
            results = {"task": args.task, "plans": plans, "types": types, "counts": counts}
            json.dump({**results, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
