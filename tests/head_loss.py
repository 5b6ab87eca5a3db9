"""Models, batches and worker runs for the chunked-loss tests (tests/test_head_loss.py):
the context tests' tiny language models (tests/context.py) trained with
`chunked_loss=5` (5 tokens a chunk: a batch of 8 x 16 tokens is 26 chunks in one
process), float64, against the same model with the whole logits in one process."""

from __future__ import annotations

from typing import Any

import torch
from context import (
    LENGTH,
    VOCAB,
    batch_of,
    bert,  # a masked LM: its head has a bias, its loss is not shifted
)
from context import gpt2 as gpt2_tied  # GPT-2 ties its head to the token embedding
from context import llama as llama_untied
from experts import batch_of as moe_batch_of
from experts import qwen3_moe  # a mixture of experts: its load-balancing loss on
from zoo import zoo_optimizer

import meshfit as mf


def eurobert() -> torch.nn.Module:  # a masked LM whose loss is transformers' shared one
    from transformers import EuroBertConfig, EuroBertForMaskedLM

    return EuroBertForMaskedLM(
        EuroBertConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=2 * LENGTH, mlp_bias=True, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3,
        )
    )  # fmt: skip


def gemma2() -> torch.nn.Module:  # soft-caps its logits between the head and the loss
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=2 * LENGTH, final_logit_softcapping=30.0,
        )
    )  # fmt: skip


def gpt() -> torch.nn.Module:  # meshfit's GPT: an lm_head Linear, no get_output_embeddings
    from meshfit.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=2 * LENGTH, n_layer=2, n_head=2, n_embd=16))


BUILDS = {
    "llama": llama_untied,
    "gpt2": gpt2_tied,
    "bert": bert,
    "eurobert": eurobert,
    "gemma2": gemma2,
    "gpt": gpt,
    "qwen3_moe": qwen3_moe,
}


def _batch(model: str, loss: str, step: int) -> Any:
    if model == "gpt":
        return batch_of("gpt", loss, step)
    if model == "qwen3_moe":  # a collator's dict (its own loss): experts' vocabulary
        return moe_batch_of(model, step)
    if model in (
        "bert",
        "eurobert",
    ):  # a masked LM's labels: -100 but where a token is to be predicted
        inputs, labels = batch_of("llama", "pair", step)
        labels = torch.where(torch.arange(LENGTH) % 3 == 0, labels, -100)
        return {**inputs, "labels": labels} if loss == "model" else (inputs, labels)
    return batch_of(model, loss, step)


def _loss_fn(model: str, loss: str) -> Any:
    if loss == "model":
        return "model"
    if loss == "plain":  # a loss of the user's own: it reads the logits
        return lambda outputs, targets: torch.nn.functional.cross_entropy(
            outputs.logits.flatten(0, 1), targets.flatten()
        )
    return mf.losses.cross_entropy(shift=model not in ("gpt", "bert", "eurobert"))


def head_run(spec: dict) -> dict:
    """`spec["model"]` under `spec["plan"]` for 3 SGD steps, float64; "loss": "pair"
    (mf.losses.cross_entropy), "model" (its own) or "plain" (a function reading the
    logits); "chunks": chunked_loss (default 5); "metrics": with a metric;
    "evaluate": an evaluation after the steps (its loss recorded too); "compile":
    compile=True; "float32": the model in float32 (default float64)."""
    from meshfit.parallel import head_loss

    # every call of the chunked loss on this rank (its count is summed); a tensor, so that
    # under compile=True the count is an input the graph adds to: a list's length would
    # be guarded on, and every step compiled the model again (measured: 3 compiles)
    chunked_calls = torch.zeros((), dtype=torch.int64)
    whole = head_loss.linear_cross_entropy

    def counted(*args: Any, **kwargs: Any) -> Any:
        chunked_calls.add_(1)
        return whole(*args, **kwargs)

    head_loss.linear_cross_entropy = counted
    try:
        return _head_run(spec, chunked_calls)
    finally:
        head_loss.linear_cross_entropy = whole


def _head_run(spec: dict, chunked_calls: torch.Tensor) -> dict:
    torch.manual_seed(1234)
    model = BUILDS[spec["model"]]()
    model = model.float() if spec.get("float32") else model.double()
    loss = spec.get("loss", "pair")
    extra = {"metrics": {"acc": mf.metrics.accuracy}} if spec.get("metrics") else {}
    engine = mf.parallelize(
        model,
        spec.get("plan"),
        loss_fn=_loss_fn(spec["model"], loss),
        optimizer=zoo_optimizer,
        chunked_loss=spec.get("chunks", 5),
        compile=spec.get("compile", False),
        **extra,
    )
    losses = [float(engine.step(_batch(spec["model"], loss, step))) for step in range(3)]
    if spec.get("evaluate"):
        losses.append(float(engine.evaluate(_batch(spec["model"], loss, 3))))
    calls = chunked_calls.clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(calls)
    return {"losses": losses, "state": engine.full_state_dict(), "chunked_calls": int(calls)}


def many_head_runs(specs: list[dict]) -> list[dict]:
    from workers import runs_or_refusals

    return runs_or_refusals(head_run, specs)
