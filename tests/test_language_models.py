"""Language-model batches, exactly: a collator's dict inputs with masks, token-weighted
losses over SFT-like batches (masked prompts, answers of their own length, right
padding) and the model's own loss, under every plan, against one process and one
micro-batch."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_run, tolerance
from workers import build_lm, lm_loss, lm_run, many_lm_runs, optimizer_factory, sft_batch

import meshfit as mf
from meshfit.trees import slice_rows

pytest.importorskip("transformers")

MODELS = ("seq_lm", "llama", "gpt2", "t5")
# What a plan cannot split, with the one meshfit line that says so: none left under tp
# (GPT-2's Conv1D projections with q|k|v fused in one, and T5's per-head position table
# and cross-attention, split as derived from the computation). GPT-2 ties its LM head
# to the token embedding: pp keeps a copy on the first and the last stage and sums
# their gradients.
REFUSED: dict[tuple[str, str], str] = {}
# A hand-written plan that splits GPT-2's c_attn like any Linear (not per q/k/v chunk),
# with the local split_size set as the derived plan sets it: it runs, and trains wrongly.
GPT2_QKV_AS_ONE_BLOCK = {
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
}
# Refused at the first stage's first forward, on that rank alone (the other stages wait
# for its activation): the launch fails with the refusal, so it gets a launch of its own.
# (T5 under pp without example_inputs; with them it trains: the test below.)
REFUSED_IN_THE_FIRST_STEP = {("t5", "pp")}


HEAD_SPLIT = {
    "bert": "; cls.predictions.decoder kept whole: its weight is tied to "
    "bert.embeddings.word_embeddings's",
    "neox": " and lm_head over its 32 outputs (gathered)",
    "gpt2": "; lm_head kept whole: its weight is tied to transformer.wte's",
    "olmo2": " and lm_head over its 32 outputs (gathered)",
    "recurrent_gemma": "; lm_head kept whole: its weight is tied to model.embed_tokens's",
}


def _rtol(model: str, plan: str | None = None) -> float:
    # Hugging Face's causal-LM loss (GPT-2's own loss here) casts the logits to float32
    # whatever the model's dtype, so its losses carry float32 rounding.
    if model == "qwen3_mqa" or (model == "qwen3" and plan == "tp=4"):
        # Qwen3's RMSNorm computes in float32 whatever the model's dtype. With k/v heads
        # shared by tp ranks (one k/v head; or 2 under tp=4), each rank's part of
        # k_norm's input gradient passes that float32 step before the parts are summed,
        # where one process rounds the whole once: float32 rounding (6e-8) of the parts.
        # Measured: 2e-9 after one step (float64 elsewhere: 1e-17; a wrong sum was
        # 1e-1); under tp=4, 1e-10 on the loss after one SGD step, 9e-8 of an update.
        return 1e-7
    return tolerance("float32" if model.startswith("gpt2") else "float64")


def _check(specs: list[dict], results: list[dict]) -> None:
    for spec, got in zip(specs, results, strict=True):
        form = next((f for f in ("tp", "pp") if f"{f}=" in spec["plan"]), None)
        expected = REFUSED.get((spec["model"], form))
        if expected is not None:
            assert "refused" in got and expected in got["refused"], (spec, got)
            assert "\n" not in got["refused"], got["refused"]  # one line
            continue
        assert "refused" not in got, (spec, got)
        ref = lm_run({**spec, "plan": None})
        rtol = _rtol(spec["model"], spec["plan"])
        if spec.get("mean") and spec["model"] != "seq_lm":
            # one process backpropagates the mean, the split run the pair (mean x count)
            # over the global count: the 1/count lands before Llama's float32 norms in
            # one and after them in the other (measured: 7.6e-11 after one SGD step;
            # your own nn.Sequential, all float64: 1.4e-16)
            rtol = tolerance("float32")
        assert_same_run(got, ref, rtol)
        assert abs(got["eval"] - ref["eval"]) <= rtol * ref["eval"], spec


@pytest.mark.slow
def test_language_models_match_one_process_on_two_workers() -> None:
    plans = ("dp=2", "fsdp=2", "tp=2", "pp=2,microbatches=4")
    specs = [
        {"model": m, "plan": p} for m in MODELS for p in plans if not _first_step_refusal(m, p)
    ]
    # A loss_fn that returns the mean over the real (not -100) targets, as
    # F.cross_entropy(ignore_index=-100) does: the coupling probe finds it and meshfit
    # trains it as (mean x count, count). Before, each rank's mean weighed its own count
    # (warned of, and a different run: these were negative controls).
    # Under pp the last stage asks the loss alone on its first micro-batch's halves.
    means = [("seq_lm", "dp=2"), ("llama", "dp=2"), ("llama", "pp=2,microbatches=2,schedule=gpipe")]
    specs += [{"model": m, "plan": p, "mean": True, "said": True} for m, p in means]
    # The same mean shifting the labels itself (Llama's loss here shifts), given a
    # collator's labels (the ids, -100 at the padding: each row's first label real, so
    # the counts of real targets as they stand are one a row off the loss's): refused
    # before as coupling the samples ("the loss function mixes them"); counted shifted now
    collated = ("dp=2", "pp=2,microbatches=2,schedule=gpipe")
    specs += [
        {"model": "llama", "plan": p, "mean": True, "said": True, "collated": True}
        for p in collated
    ]
    # A loss_fn returning the model's own `outputs.loss` under pp: the last stage's
    # halves of an output already reduced are the whole, so it could not tell; pp's
    # question before the cut, the model run on each half, can (warned of and another
    # run before: 3.44575 where one process has 3.44331 at the second step)
    reads_loss = {
        "model": "llama",
        "plan": "pp=2,microbatches=2,schedule=gpipe",
        "said": True,
        "collated": True,
        "reads_loss": True,
        "mean": True,
    }
    specs.append(reads_loss)
    # A mean ignoring the pad id (labels the ids, padded with 0, ignore_index=0), as
    # scripts that predate -100 write it: refused before as coupling the samples
    specs += [
        {"model": "llama", "plan": p, "mean": True, "said": True, "pad_id": True} for p in collated
    ]
    # and where one rank's rows are all unpadded (it finds no padding, so it cannot
    # disagree on it): refused before as coupling the samples
    specs.append(
        {
            "model": "llama",
            "plan": "dp=2",
            "mean": True,
            "said": True,
            "pad_id": True,
            "full_rows": True,
        }
    )
    # pp with micro-batches of one sample: no halves on the last stage, so pp's question
    # before the cut asks the first batch's first four samples (warned of and another
    # run before: 3.39039921 where one process has 3.42305234 at the second step)
    one_sample = {"model": "llama", "plan": "pp=2,microbatches=8", "mean": True, "said": True}
    specs.append(one_sample)
    # and of two samples, whose halves (one sample each) hold 7 real targets each here:
    # the four samples' halves hold 14 and 13 (the negative control before)
    specs.append({"model": "llama", "plan": "pp=2,microbatches=4", "mean": True, "said": True})
    # The same two through mf.fit, which builds the split on the dataset's first samples
    # before any step: its example had no targets, so pp's questions before the cut ran
    # the forward alone (warned of and another run before: 3.39040 and 3.42435 where one
    # process has 3.42305 at the second step)
    specs += [{**one_sample, "fit": True}, {**reads_loss, "fit": True}]
    # A sum over the real targets of an HF model's output object under pp: its halves
    # were made dicts, the loss (reading .logits) failed on them, and pp divided the sum
    # by its micro-batch count with no word (measured: 86.89 where one process has 173.79)
    specs.append({"model": "llama", "plan": "pp=2,microbatches=2,schedule=gpipe", "sum": True})
    # Negative controls in the same launch: the mean under pp with 4 micro-batches given
    # example_inputs without targets (the build at parallelize: no loss question before
    # the cut), whose first micro-batch's halves (one sample each) hold 7 real targets
    # each, so a mean over them cannot be told from a plain mean (warned of: the run
    # differs), and the model's own loss without the global count (num_items_in_batch
    # not passed: its per-rank mean), must train a different run.
    controls = [
        {
            "model": "llama",
            "plan": "pp=2,microbatches=4",
            "mean": True,
            "said": True,
            "options": {"example_inputs": slice_rows(sft_batch("llama", 8, 0)[0], 0, 2)},
        },
        {"model": "gpt2", "plan": "dp=2", "model_mean": True},
        # the tied embedding's two copies under pp, without their gradients summed
        {"model": "gpt2", "plan": "pp=2,microbatches=4", "tied_unsummed": True},
        # GPT-2's fused q|k|v split as one block: rank 0 gets all of q and half of k
        {
            "model": "gpt2",
            "plan": "tp=2",
            "options": {"tp_plan": GPT2_QKV_AS_ONE_BLOCK},
            "local_split_size": True,
        },  # fmt: skip
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_lm_runs, nproc=2, args=([*specs, *controls],))
    _check(specs, results[: len(specs)])
    for control, got in zip(controls, results[len(specs) :], strict=True):
        ref = lm_run({"model": control["model"]})
        with pytest.raises(AssertionError):
            assert_same_run(got, ref, _rtol(control["model"]))
    # the undecided mean says so; the others have nothing to warn of
    assert any("Return a pair" in w for w in results[len(specs)]["warned"]), results[len(specs)]
    means = [got for spec, got in zip(specs, results, strict=False) if spec.get("mean")]
    assert len(means) == 13 and not any("-100" in w for got in means for w in got["warned"])


@pytest.mark.slow
def test_gradient_accumulation_weighs_every_token_alike() -> None:
    """dp=1 with 4 micro-batches in this process: the micro-batches hold different
    numbers of real tokens, so only the global count reproduces one big batch."""
    specs = [{"model": m, "plan": "microbatches=4"} for m in MODELS]
    _check(specs, [lm_run(spec) for spec in specs])
    # a loss_fn returning the mean over the real targets too (trained as (mean x count,
    # count); before, each micro-batch's mean weighed its own count: a different run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing to warn of
        mean = lm_run({"model": "seq_lm", "plan": "microbatches=4", "mean": True})
    assert_same_run(mean, lm_run({"model": "seq_lm", "mean": True}))


@pytest.mark.slow
def test_layers_whose_masks_the_loop_picks_by_count_keep_them_under_pp(tmp_path) -> None:
    """EXAONE 4 (6 layers, sliding-window and global alternating; Gemma 2 and 3,
    GPT-OSS, OLMo 3 and Qwen2's sliding windows are written the same way) picks each
    layer's mask by the loop's count (`causal_mask_mapping[config.layer_types[i]]`),
    and a pipeline stage's loop counts its own blocks from 0. The balanced cut (block 3)
    gave the second stage's layers the other kind's masks and trained another run with
    no word (checked on the old code); the cut now starts where the pattern repeats
    (block 2 or 4) and trains the one-process run. pp_split=[3] is refused naming the
    starts that keep the masks, and OLMo 3 (3 sliding layers, then a global one; 4 in
    all) has none and is refused. Built on meta with weights= too, where the cut's
    example forward cannot run (transformers' masks read values): the blocks' arguments
    are read from the prologue alone. ModernBERT (4 layers, global and local) reads
    each layer's attention_type off the layer in its loop; RoFormer's layers are given
    rotary tables made from a frozen sinusoidal table outside them (refused: a placeholder
    on the second stage)."""
    from context import BUILDS, cp_run, many_cp_runs

    torch.manual_seed(1234)  # cp_run's weights, saved for the model built on meta
    model = BUILDS["exaone4_6"]().double()
    mf.parallelize(model, None, loss_fn="model").save_model(str(tmp_path / "w"))
    meta = {"model": "exaone4_6", "plan": "pp=2", "meta": True}
    specs = [
        {"model": "exaone4_6", "plan": "pp=2"},
        {**meta, "options": {"weights": str(tmp_path / "w")}},
    ]
    # ModernBERT's loop reads each layer's attention_type off the layer: the first stage
    # reads it off the stand-in for the second stage's first layer (before, an
    # AttributeError told as the batch's fault)
    specs.append({"model": "modernbert_4", "plan": "pp=2"})
    controls = [
        {"model": "exaone4_6", "plan": "pp=2", "options": {"pp_split": [3]}},
        {"model": "olmo3", "plan": "pp=2"},
        # RoFormer's layers get rotary tables its encoder makes from a frozen sinusoidal
        # table, a placeholder on the second stage (before: 5.7e-8 apart at the first
        # step in float64, and growing, with no word)
        {"model": "roformer", "plan": "pp=2"},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_cp_runs, nproc=2, args=([*specs, *controls],))
    got, on_meta, modernbert, split3, olmo, roformer = results
    alone = cp_run({**specs[0], "plan": None})
    for run in (got, on_meta):
        assert "refused" not in run, run
        assert_same_run(run, alone, tolerance("float64"))
    assert "refused" not in modernbert, modernbert
    assert_same_run(modernbert, cp_run({**specs[2], "plan": None}), tolerance("float64"))
    assert "depends on weights outside the block" in roformer.get("refused", ""), roformer
    assert "roformer.encoder.layer.0" in roformer["refused"]
    assert "pp_split=[3] starts a stage at block 3" in split3.get("refused", ""), split3
    assert "start stages at blocks from [2, 4]" in split3["refused"]
    assert "cannot cut this model into 2 stages" in olmo.get("refused", ""), olmo
    assert "block 3 gets another keyword 'attention_mask' than block 0" in olmo["refused"]


@pytest.mark.slow  # one launch of 2 workers: tiny BERTs, Llama, SegFormer, T5, BARTs
def test_a_masked_lm_s_own_mean_loss_trains_the_one_process_run_under_dp_and_fsdp() -> None:
    """BERT's own masked-LM loss is `CrossEntropyLoss()`, a mean over the rank's masked
    tokens: under dp it was a mean of the ranks' means (warned, another run: 4.6e-5 apart
    at the first step). meshfit now adds up each rank's mean times its count (a rank with
    no masked token adds 0) over the global count, and trains one process's run. So do
    token classifiers (NER), whose own loss is such a mean over the tags that are not
    -100: BERT's `CrossEntropyLoss()` and Llama's (transformers' shared loss, called
    without the count; before, a mean per rank: BERT under dp=2 6.4e-3 apart), and
    semantic segmentation (SegFormer's mean over the pixels not labelled 255: before,
    refused under dp as a loss that couples the samples), and encoder-decoders (T5's
    and BART's `CrossEntropyLoss()` over their labels; before, a mean per rank: T5
    under dp=2 1.3e-2 apart), BART's decoder alone too (BartForCausalLM: its labels
    counted as they stand, not shifted as a causal LM's), and a causal LM whose own
    `CrossEntropyLoss()` is a mean over the labels it shifts itself (CLVP's decoder:
    before, refused under dp as a loss that couples the samples). A subclass whose
    forward adds a z-loss over every token is no such mean: the coupling probe refuses it
    before any update, saying what loss_fn='model' took it for."""
    from workers import masked_lm_runs

    models = ("bert", "bert_ner", "llama_ner", "segformer", "t5", "bart", "bart_decoder", "clvp")
    specs = [{"model": m, "plan": p} for m in models for p in ("dp=2", "fsdp=2")]
    specs.append({"model": "bert_z", "plan": "dp=2"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        *runs, z = mf.launch(masked_lm_runs, nproc=2, args=(specs,))
        alone = masked_lm_runs([{"model": m, "plan": None} for m in models])
    for spec, got in zip(specs, runs, strict=False):
        ref = alone[models.index(spec["model"])]
        rtol = 1e-6 if spec["model"] == "llama_ner" else 1e-12  # its loss in float32
        assert "refused" not in got, got
        assert got["losses"] == pytest.approx(ref["losses"], rel=rtol), spec
        for name, value in ref["weights"].items():
            assert torch.allclose(got["weights"][name], value, rtol=rtol, atol=1e-12), name
    assert "the loss couples the samples of a batch" in z.get("refused", ""), z
    assert "is not such a mean: pass a loss_fn over its logits" in z["refused"]
    assert z["moved"] == []


@pytest.mark.slow
def test_language_models_match_one_process_under_dp_x_pp(tmp_path) -> None:
    specs = [{"model": m, "plan": "dp=2,pp=2"} for m in MODELS if m != "t5"]
    # the tied embedding on sharded stages, and over four stages (the first and the
    # last rank of the pipeline get a group of their own)
    specs += [{"model": "gpt2", "plan": "fsdp=2,pp=2"}, {"model": "gpt2_4", "plan": "pp=4"}]
    # the fused q|k|v split per chunk on tp, replicated by DDP, and sharded again by
    # FSDP2 on the same dimension (c_attn.bias: DTensor's own full_tensor scrambled it,
    # placements.py)
    saved = str(tmp_path / "ck")  # and its checkpoint loads into one process exactly
    specs += [
        {"model": "gpt2", "plan": "dp=2,tp=2"},
        {"model": "gpt2", "plan": "fsdp=2,tp=2", "save": saved},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_lm_runs, nproc=4, args=(specs,))
    sgd = optimizer_factory("sgd")
    engine = mf.parallelize(build_lm("gpt2"), None, loss_fn=lm_loss("gpt2"), optimizer=sgd)
    engine.load(saved)
    loaded = engine.full_state_dict()
    for name, value in results[-1]["state"].items():
        assert torch.equal(loaded[name], value), name
    specs[-1].pop("save")  # the one-process reference saves nothing
    _check(specs, results)


@pytest.mark.slow
def test_one_key_value_head_stays_whole_under_tp_and_trains_the_one_process_run() -> None:
    """Multi-query attention (one k/v head for all q heads): tp splits q and o and keeps
    k and v whole on every rank, their gradients (and Qwen3's k_norm's) summed over the
    tp ranks, as Megatron does. It was refused: one head cannot be cut in two."""
    specs = [{"model": m, "plan": "tp=2"} for m in ("llama_mqa", "qwen3_mqa")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_lm_runs, nproc=2, args=(specs,))
    _check(specs, results)
    for got in results:
        assert "k_proj kept whole: one key/value head, on every tp rank" in got["tp_split"], got


@pytest.mark.slow
def test_fewer_key_value_heads_than_tp_ranks_train_the_one_process_run() -> None:
    """Grouped-query attention with 2 k/v heads under tp=4 (Llama, and Qwen3 with its
    per-head k_norm): k and v stay whole on every rank, each rank keeps the one k/v head
    its q heads read, and the gradients are summed over the tp ranks. It was refused:
    4 ranks cannot cut 2 heads."""
    specs = [{"model": m, "plan": "tp=4"} for m in ("llama", "qwen3")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_lm_runs, nproc=4, args=(specs,))
    _check(specs, results)
    for got in results:
        assert "k_proj kept whole: 2 key/value heads for tp=4" in got["tp_split"], got


def test_per_head_norms_under_tp_train_the_one_process_run() -> None:
    """Qwen3's q_norm / k_norm (one weight shared by all heads) act on each tp rank's own
    heads, so each rank's gradient is its heads' part: tp sums the parts over the ranks.
    Controls: without the sum, the split's backward check refuses the model, naming the
    norm; without the check too, the run trains apart from one process (float64: the
    loss and q_norm drift by ~1e-7 and ~4e-4 in 3 steps)."""
    specs = [
        {"model": "qwen3", "plan": "tp=2"},
        {"model": "qwen3", "plan": "tp=2", "unsummed": True},
        {"model": "qwen3", "plan": "tp=2", "unsummed": True, "unchecked": True},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, refused, apart = mf.launch(many_lm_runs, nproc=2, args=(specs,))
    _check(specs[:1], [got])
    assert re.search(r"q_norm\.weight's gradient is [\d.e-]+ off one process's", refused["refused"])
    assert "\n" not in refused["refused"]
    with pytest.raises(AssertionError):
        assert_same_run(apart, lm_run({"model": "qwen3"}), _rtol("qwen3"))


def _first_step_refusal(model: str, plan: str) -> bool:
    return any(model == m and f"{form}=" in plan for m, form in REFUSED_IN_THE_FIRST_STEP)


@pytest.mark.slow
def test_t5_under_pp_sends_its_position_bias_across_the_cut() -> None:
    """T5's first encoder block computes a position bias from its own weights and the
    forward's loop hands it to the next blocks: the second stage recomputed it as zeros
    (measured before any check: losses apart from step 0), then pp refused T5. Now the
    check forward on an example micro-batch finds it (example_inputs, else the engine's
    first batch), the stage before the cut sends it with the hidden state and gets its
    gradient back: the one-process run, over 4 micro-batches. Built before any batch
    (the runner read first) nothing has found it, so the cut refuses, before any update."""
    spec = {"model": "t5", "plan": "pp=2,microbatches=4"}
    example = sft_batch("t5", 2, 0)[0]
    sent, first = mf.launch(
        many_lm_runs, nproc=2, args=([{**spec, "options": {"example_inputs": example}}, spec],)
    )
    reference = lm_run({"model": "t5"})
    assert_same_run(sent, reference, _rtol("t5"))
    assert_same_run(first, reference, _rtol("t5"))
    unknown = r"cannot cut before block 'encoder\.block\.1'.* pass example_inputs="
    with pytest.raises(mf.MeshfitError, match=unknown):  # one rank refuses at its step
        mf.launch(lm_run, nproc=2, args=({**spec, "early": True},))


def test_a_mean_over_ignored_targets_trains_the_one_process_run_or_is_refused() -> None:
    """A loss_fn returning the mean over the real (not -100) targets trains the one-process
    run under micro-batches, with nothing to warn of (before: warned of, and each
    micro-batch's mean weighed its own count; dp and pp: the 2-worker test's cells). One
    whose divisor is not their count (class weights: the sum of the targets' weights) is
    refused in one line at the first step."""
    from workers import LM_VOCAB, build_lm, optimizer_factory

    def mean_loss(outputs, targets):
        total, count = mf.losses.cross_entropy()(outputs, targets)
        return total / count

    weights = torch.linspace(0.5, 2.0, LM_VOCAB, dtype=torch.float64)

    def weighted_mean(outputs, targets):
        flat = outputs.reshape(-1, outputs.shape[-1])
        return F.cross_entropy(flat, targets.reshape(-1), weight=weights, ignore_index=-100)

    def run(plan: str | None, loss: object, steps: int = 2) -> list[float]:
        engine = mf.parallelize(
            build_lm("seq_lm"), plan, loss_fn=loss, optimizer=optimizer_factory("sgd")
        )
        return [float(engine.step(sft_batch("seq_lm", 8, s))) for s in range(steps)]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split = run("microbatches=2", mean_loss)
    assert split == pytest.approx(run(None, mean_loss), rel=1e-12)
    with pytest.raises(mf.MeshfitError, match="the loss couples the samples") as refused:
        run("microbatches=2", weighted_mean, steps=1)
    assert "\n" not in str(refused.value)


def test_fit_eval_loss_of_a_token_loss_is_the_mean_over_every_token() -> None:
    """The eval loss of a (sum, count) loss was the mean of per-batch means: not the
    token mean over the evaluation set, and it moved with the eval batch size. It must
    equal one batch holding the whole set, at any batch size."""
    from workers import build_lm

    ids, targets = sft_batch("seq_lm", 32, 0)  # answers of different lengths
    samples = (ids, targets)
    loss_fn = mf.losses.cross_entropy()

    def eval_loss(batch_size: int) -> float:
        history = mf.fit(
            build_lm("seq_lm"),
            samples,
            loss_fn=loss_fn,
            eval_dataset=samples,
            batch_size=batch_size,
            max_steps=1,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.0),  # weights kept
            progress=False,
        )
        return history.eval_losses[-1][1]

    total, count = loss_fn(build_lm("seq_lm")(ids), targets)
    whole = float(total / count)
    for batch_size in (4, 8, 32):
        assert eval_loss(batch_size) == pytest.approx(whole, rel=1e-12), batch_size
    per_batch = [
        loss_fn(build_lm("seq_lm")(ids[i : i + 4]), targets[i : i + 4]) for i in range(0, 32, 4)
    ]
    assert sum(float(s / c) for s, c in per_batch) / 8 != pytest.approx(whole, rel=1e-6)


def test_model_loss_needs_the_labels_in_a_mapping() -> None:
    from workers import build_lm

    engine = mf.parallelize(build_lm("gpt2"), loss_fn="model")
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(mf.MeshfitError, match="with loss_fn='model' a batch is the mapping"):
        engine.step((ids, ids))
    # without labels the model computes no loss (CLIP with return_loss=True does):
    # refused by name, not trained
    with pytest.raises(mf.MeshfitError, match=r"output has none; put the labels in the batch"):
        engine.step({"input_ids": ids})


def test_fit_trains_on_collator_dicts_and_counts_real_tokens() -> None:
    """fit with a dataset of dict samples (as a tokenized dataset gives them) and the
    model's own loss; tokens/s counts the tokens under the attention mask."""
    from workers import build_lm

    batch = sft_batch("gpt2", 16, 0)
    samples = [{k: v[i] for k, v in batch.items()} for i in range(16)]
    history = mf.fit(
        build_lm("gpt2"),
        samples,
        loss_fn="model",
        batch_size=8,
        max_steps=2,
        log_every=1,
        progress=False,
    )
    assert len(history) == 2 and all(r["loss"] > 0 for r in history)
    # tokens/s over samples/s = a step's real tokens per sample; the two steps (one
    # shuffled epoch) hold every sample once, so their real tokens add up to the mask's
    tokens = [8 * r["tokens_per_s"] / r["samples_per_s"] for r in history]
    assert sum(tokens) == pytest.approx(batch["attention_mask"].sum().item(), abs=0.5)
    assert sum(tokens) < 16 * batch["input_ids"].shape[1]  # not the padded count


def test_model_loss_sums_only_the_shared_token_losses() -> None:
    """num_items_in_batch is passed to the causal-LM and masked-LM token losses alone: a
    classification head's loss (and T5's own) is a mean whatever **kwargs it takes."""
    from transformers import LlamaForSequenceClassification
    from workers import build_lm, llama_config

    from meshfit.losses import ModelOwnLoss

    config = llama_config(num_hidden_layers=1, pad_token_id=0)
    kinds = {
        "gpt2": (True, True),
        "llama": (True, True),
        "t5": (False, False),
    }
    for name, (sums, shifted) in kinds.items():
        loss = ModelOwnLoss(build_lm(name))
        assert (loss.sums, loss.shifted) == (sums, shifted), name
    classifier = ModelOwnLoss(LlamaForSequenceClassification(config))
    assert not classifier.sums and classifier.model_kwargs() == {}


@pytest.mark.slow  # 48 s on the shared 2-core VM
def test_encoder_and_fused_per_head_models_match_one_process_under_tp() -> None:
    """BERT (query/key/value and three `dense` layers, no names to go by), GPT-NeoX
    (q, k, v fused per head) and OLMo2 (a norm over all of q: its attention stays whole)
    under tp=2; RecurrentGemma, which keeps the recurrent state of its last forward on a
    module (its tp trial copies the block: torch's deepcopy refused that tensor, and the
    split failed with torch's error); GPT-2's sharded checkpoint (its fused q|k|v is
    split chunk by chunk) loads in one process. Negative control: NeoX's fused layer
    split as q|k|v chunks (GPT-2's layout, wrong for NeoX) trains a different run (GPT-2's
    split as one block: the everyday matrix test's controls)."""
    import tempfile

    from workers import build_lm, optimizer_factory

    wrong = {
        "gpt_neox.layers.*.attention.query_key_value": "colwise:3",
        "gpt_neox.layers.*.attention.dense": "rowwise",
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/gpt2"
        specs = [
            {"model": "bert", "plan": "tp=2"},
            {"model": "neox", "plan": "tp=2"},
            {"model": "gpt2", "plan": "tp=2", "save": path},
            {"model": "olmo2", "plan": "tp=2"},
            {"model": "recurrent_gemma", "plan": "tp=2"},
            {"model": "neox", "plan": "tp=2", "options": {"tp_plan": wrong}},
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = mf.launch(many_lm_runs, nproc=2, args=(specs,))
        for spec, got in zip(specs[:5], results[:5], strict=True):
            assert "refused" not in got, (spec, got)
            share = re.match(r"tensor parallel splits ([\d.]+)% of \w+ parameters", got["tp_split"])
            # OLMo2 keeps its attention whole (its q/k norm spans all heads): MLP only;
            # RecurrentGemma its recurrent block (the scan reads every channel)
            least = {"olmo2": 50, "recurrent_gemma": 30}.get(spec["model"], 95)
            assert share and float(share[1]) >= least, got["tp_split"]
            # an untied LM head is split over the vocabulary; one tied to the embedding is not
            assert HEAD_SPLIT[spec["model"]] in got["tp_split"], got["tp_split"]
            ref = lm_run({**spec, "plan": None, "save": None})
            if spec["model"] == "bert":
                # the key bias gets an exactly-zero gradient (softmax ignores it): its
                # values are rounding noise either way
                for state in (got["state"], ref["state"]):
                    for name in [n for n in state if n.endswith("key.bias")]:
                        del state[name]
            assert_same_run(got, ref, _rtol("gpt2"))
        for control, got in zip(specs[5:], results[5:], strict=True):
            assert "refused" not in got, got
            with pytest.raises(AssertionError):
                assert_same_run(got, lm_run({"model": control["model"]}), _rtol("gpt2"))
        engine = mf.parallelize(
            build_lm("gpt2"), None, loss_fn="model", optimizer=optimizer_factory("sgd")
        )
        engine.load(path)
        loaded = engine.user_model.state_dict()
        for name, value in results[2]["state"].items():
            assert torch.equal(loaded[name], value), name
        assert len(engine.optimizer.state) == len(list(engine.user_model.parameters()))


def test_recomputed_gpt2_trains_without_its_cache_and_says_so() -> None:
    """GPT-2's config has use_cache=True: a block recomputed in backward appended its keys
    to the cache a second time (24 keys for 12 queries, even in one process). The
    training forward of a recomputed block runs without the cache, as Hugging Face's own
    gradient checkpointing does, said once; the run is the plain one, and the model is
    unchanged: its config keeps use_cache and its evaluation forward returns a cache."""
    from workers import build_lm, lm_loss, optimizer_factory

    ref = lm_run({"model": "gpt2"})
    for mode in ("full", "selective"):
        with pytest.warns(UserWarning, match=r"GPT2Block.*without the cache") as said:
            got = lm_run({"model": "gpt2", "plan": f"checkpointing={mode}"})
        assert len([w for w in said if "KV cache" in str(w.message)]) == 1
        assert_same_run(got, ref, _rtol("gpt2"))

    model = build_lm("gpt2")
    engine = mf.parallelize(
        model, "checkpointing=full", loss_fn=lm_loss("gpt2"), optimizer=optimizer_factory("sgd")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.step(sft_batch("gpt2", 8, 0))
    assert model.config.use_cache
    with torch.no_grad():
        out = model(input_ids=torch.ones(2, 5, dtype=torch.long))
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 5
