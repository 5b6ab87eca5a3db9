"""Context parallel (`Plan(cp=N)`): each sequence cut over N ranks (two load-balanced
chunks each), attention over the whole sequence, positions and targets as one process
sees them. Every run against one process on the same global batch, float64."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from context import (  # noqa: E402
    LENGTH,
    batch_of,
    cp_run,
    documents,
    llama,
    many_cp_runs,
)
from helpers import tolerance  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.verification.run import weight_differences  # noqa: E402

RTOL = tolerance("float64")
# transformers' causal-LM loss upcasts the logits to float32: the model's own loss value
# sums in float32 (the weights stay float64)
MODEL_LOSS_RTOL = 1e-5


def distance(got: dict, ref: dict) -> tuple[float, float]:
    losses = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    weights = max(weight_differences(got["state"], ref["state"]).values())
    return losses, weights


# Gemma 2's RMSNorm computes in float32 and casts back: the cut's reordered key sums
# (1e-16 apart in float64) round differently there, in forward and backward (measured
# over 3 steps: losses 3.4e-10, weights 5.7e-8 apart; float32's roundoff is 6e-8)
FLOAT32_INSIDE_RTOL = 1e-6


def assert_same(spec: dict, got: dict, ref: dict) -> None:
    assert "refused" not in got, (spec, got.get("refused"))
    losses, weights = distance(got, ref)
    loss_rtol = MODEL_LOSS_RTOL if spec.get("loss") == "model" else RTOL
    rtol = FLOAT32_INSIDE_RTOL if spec["model"] == "gemma2_ids" else RTOL
    assert losses <= max(loss_rtol, rtol) and weights <= rtol, (spec, losses, weights)
    assert got["metrics"] == pytest.approx(ref["metrics"], rel=RTOL), spec


@pytest.mark.slow
def test_cp2_trains_the_one_process_run_on_every_kind_of_model() -> None:
    """cp=2 on 2 workers: transformers' Llama (rotary, grouped-query attention), Qwen3
    (q/k norms), GPT-2 (learned positions), Mistral (a sliding window of 5 over 16
    tokens: exact), Llama with its own loss (shift_labels), nanoGPT's model.py and
    meshfit's GPT (their own torch.arange positions and F.scaled_dot_product_attention),
    packed documents (position_ids restarting), Qwen3-MoE with its load-balancing loss
    (its router statistics summed over the cp ranks' tokens: before, each rank added the
    loss of its own tokens, 3.4e-2 apart at the first step; the probe refused it, naming
    attention), EXAONE 4 (a global layer beside sliding ones), and encoders: BERT and
    ModernBERT (every token reads every other; ModernBERT's local layers a window either
    side) on a masked-LM collator's batches (before, cp's attention was causal whatever
    the layer: refused naming their attention).
    Controls: a model whose attention is
    written by hand is refused by the first step's probe, naming the module; rank 1
    holding contiguous chunks instead of its load-balanced pair is refused the same way
    (the cut no longer keeps the loss); LFM2 and Qwen3-Next, whose layers carry a state
    along the sequence, are refused in float32 too."""
    specs = [
        *({"model": m, "plan": "cp=2"} for m in ("llama", "qwen3", "gpt2", "mistral")),
        {"model": "llama", "plan": "cp=2", "loss": "model"},
        *({"model": m, "plan": "cp=2"} for m in ("nanogpt", "gpt")),
        {"model": "llama", "plan": "cp=2", "loss": "model", "packed": True},
        {"model": "qwen3_moe", "plan": "cp=2", "loss": "model"},
        # left padding: cp's attention reads transformers' padding mask (before, real
        # tokens read the padding: 5.9e-5 apart at the first step, 7.2e-4 by the third,
        # with no word when the first row was whole; refused naming Llama's o_proj when
        # it was not)
        {"model": "llama", "plan": "cp=2", "left_padded": "first whole"},
        {"model": "llama", "plan": "cp=2", "left_padded": "all"},
        {"model": "mistral", "plan": "cp=2", "left_padded": "all"},
        # metrics get the targets the loss gets: shifted before the cut where the loss
        # shifts (before, mf.metrics.accuracy read them shifted under cp and unshifted in
        # one process: 0.026 against 0.0 at the first step)
        {"model": "llama", "plan": "cp=2", "metrics": True},
        {"model": "llama", "plan": "cp=2", "loss": "model", "metrics": True},
        {"model": "llama", "plan": "cp=2", "evaluate_first": True},
        # its attention scores capped, as transformers' eager attention caps them, and its
        # token ids given alone, by name, with the rank's positions beside them (before,
        # the cap was ignored, 5.9e-7 apart at the first step, and ids given alone left
        # the model making positions 0..local length: refused naming its rotary table)
        {"model": "gemma2_ids", "plan": "cp=2"},
        # a learned sink per head in the softmax (before, refused naming its o_proj)
        {"model": "gpt_oss", "plan": "cp=2"},
        # a global layer that passes no window beside a window-sized attribute (before,
        # cp read the attribute and windowed it: refused, 4.3e-3 apart)
        {"model": "exaone4", "plan": "cp=2"},
        # encoders: transformers' is_causal = False read from the layer, windows either side
        *({"model": m, "plan": "cp=2"} for m in ("bert", "modernbert")),
        # BERT's own loss, a mean over the rank's masked tokens, times their count
        {"model": "bert", "plan": "cp=2", "loss": "model"},
        {"model": "modernbert", "plan": "cp=2", "left_padded": "all"},
    ]
    controls = [
        {"model": "hand_attention", "plan": "cp=2"},
        {"model": "llama", "plan": "cp=2", "undone_on_rank1": True},
        {"model": "llama", "plan": "cp=2", "predict": True},
        {"model": "gpt", "plan": "cp=2", "loss": "masked_mean"},
        {"model": "llama", "plan": "cp=2", "loss": "shifted_here"},
        {"model": "gpt", "plan": "cp=2", "metrics": "mean"},
        # the probe runs at the first evaluation too (before, an evaluation before any
        # step was not checked: it reported another loss with no word)
        {"model": "hand_attention", "plan": "cp=2", "evaluate_first": "only"},
        # a refused step tried again is refused again (before, the probe counted as done
        # and the second try trained the wrong run)
        {"model": "hand_attention", "plan": "cp=2", "retry": True},
        # layers that carry a state along the sequence, in float32: at initial weights the
        # cut moved the loss by 8.5e-8 (LFM2's convolution) and 1.6e-5 (Qwen3-Next's
        # delta net), under float32's rounding, and both trained another run with no word;
        # their layers' outputs moved by 0.6 and 0.5 (now refused, naming the layer)
        {"model": "lfm2", "plan": "cp=2", "float32": True},
        {"model": "qwen3_next", "plan": "cp=2", "float32": True},
        # a speech model: cp cuts its audio samples (input_values, beside their mask), and
        # its convolutions fail on the probe's window: refused as the cut's (before, told
        # "give batches the model and loss_fn take"); a batch of the wrong dtype (audio in
        # float64, the model in float32) still fails on the first row whole: the batch's
        {"model": "wav2vec2", "plan": "cp=2", "loss": "model"},
        {"model": "wav2vec2", "plan": "cp=2", "loss": "model", "float32": True},
        # an encoder-decoder: refused from its config in one line (before, at the first
        # step's probe, naming a module of its encoder)
        {"model": "t5", "plan": "cp=2", "loss": "model"},
        # a statistic of the tokens kept in buffers (parallel/context/statistics.py): a VQ
        # codebook the next forward reads, refused naming it (before, refused as a cut
        # that breaks the model, naming the LM head, with the fix for attention); under
        # sync_batchnorm=False each rank keeps its own: another run, said; an observed
        # range read by nothing: the one-process weights, said at start-up
        {"model": "codebook", "plan": "cp=2"},
        # asked at the first training step, after an evaluation too (whose forward
        # updates no buffer: asked only there, it found none)
        {"model": "codebook", "plan": "cp=2", "evaluate_first": True},
        {"model": "codebook", "plan": "cp=2", "options": {"sync_batchnorm": False}},
        {"model": "observed", "plan": "cp=2"},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_cp_runs, nproc=2, args=([*specs, *controls],))
    for spec, got in zip(specs, results, strict=False):
        assert_same(spec, got, cp_run({**spec, "plan": None}))
    hand, undone, predict, masked_mean, shifted_here, mean_metric, evaluated, retried, *rest = (
        results[len(specs) :]
    )
    *state, speech, wrong_dtype, t5, codebook, evaluated_codebook, own_codebook, observed = rest
    assert codebook.get("refused", "").startswith(
        "context parallel cannot cut this model's sequences: buffer 'vq.embed' (and 2 more"
    ), codebook
    assert "from the tokens it sees, and the forward reads it" in codebook["refused"]
    assert "attention" not in codebook["refused"] and "head" not in codebook["refused"]
    assert evaluated_codebook.get("refused") == codebook["refused"], evaluated_codebook
    reference = cp_run({"model": "codebook"})
    assert distance(own_codebook, reference)[1] > 1e-3  # each rank's own codebook
    assert (
        "buffer 'vq.embed'" in own_codebook["said"]
        and "not the one-process run" in (own_codebook["said"])
    )
    reference = cp_run({"model": "observed"})
    assert (
        "buffer 'seen_max' is updated by the training forward from the tokens" in (observed["said"])
    ), observed.get("said", observed)
    assert observed["state"]["seen_max"] < reference["state"]["seen_max"]  # a rank's tokens
    weights = {k: v for k, v in reference["state"].items() if k != "seen_max"}
    assert_same(
        {"model": "observed"}, {**observed, "state": weights}, {**reference, "state": weights}
    )
    assert "T5ForConditionalGeneration is an encoder-decoder" in t5.get("refused", ""), t5
    cut = "cp=2 cuts the second dimension of input_values, attention_mask (1600 long)"
    assert cut in speech.get("refused", "") and "\n" not in speech["refused"], speech
    assert "without cp" in speech["refused"], speech
    assert "failed inside the model or loss_fn" in wrong_dtype.get("refused", ""), wrong_dtype
    assert "float64" in wrong_dtype["refused"], wrong_dtype
    assert "context parallel" not in wrong_dtype["refused"], wrong_dtype
    assert "context parallel cannot cut this model's sequences" in hand.get("refused", ""), hand
    assert "out (Linear)" in hand["refused"] and "\n" not in hand["refused"]
    assert "context parallel cannot cut this model's sequences" in undone.get("refused", "")
    assert "predict" in predict.get("refused", "") and "\n" not in predict["refused"], predict
    # A loss the cut changes while every module agrees is named as the loss, with its fix
    # (before, both were told their attention must run through F.scaled_dot_product_attention)
    assert "cannot cut this loss" in masked_mean.get("refused", ""), masked_mean
    assert "returns a mean" in masked_mean["refused"]
    assert "mf.losses.cross_entropy(ignore_index=-100)" in masked_mean["refused"]
    assert "cannot cut this loss" in shifted_here.get("refused", ""), shifted_here
    assert "shifts the targets itself" in shifted_here["refused"]
    assert "metric 'acc' returns a mean" in mean_metric.get("refused", ""), mean_metric
    assert "out (Linear)" in evaluated.get("refused", ""), evaluated
    assert "out (Linear)" in retried.get("refused", ""), retried
    for got, layer in zip(state, ("(Lfm2ShortConv)", "(Qwen3NextGatedDeltaNet)"), strict=True):
        assert "cannot cut this model's sequences" in got.get("refused", ""), got
        assert layer in got["refused"] and "a state along the sequence" in got["refused"]


@pytest.mark.slow
def test_cp_composes_with_dp_fsdp_tp_and_pp_and_cp4() -> None:
    """On 4 workers: cp=4 (16 tokens in 8 chunks of 2), dp x cp, fsdp x cp (FSDP2 shards
    over fsdp x cp), cp x tp, cp x pp; Llama and nanoGPT, each the one-process run.
    fsdp x cp on rows whose probe windows differ (one share's first row starts with a
    long prompt, so its window is the row's end): every rank runs every window (before,
    that rank ran one forward more than its shard peers, and FSDP2's gathers hung).
    Controls under cp x pp, where the first step's probe goes through the stages: a mean
    loss over masked tokens and attention written by hand are refused (before, both
    trained another run with no word: 3.4712 against 3.4684 at the first step)."""
    plans = ("cp=4", "dp=2,cp=2", "fsdp=2,cp=2", "cp=2,tp=2", "cp=2,pp=2")
    specs = [{"model": m, "plan": p} for m in ("llama", "nanogpt") for p in plans]
    specs.append({"model": "llama", "plan": "fsdp=2,cp=2", "long_prompt": True})
    specs.append({"model": "llama", "plan": "cp=2,pp=2", "metrics": True})
    controls = [
        {"model": "gpt", "plan": "cp=2,pp=2", "loss": "masked_mean"},
        {"model": "hand_blocks", "plan": "cp=2,pp=2"},
        {"model": "hand_blocks", "plan": "cp=2,pp=2", "evaluate_first": "only"},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_cp_runs, nproc=4, args=([*specs, *controls],))
    references = {}
    for spec, got in zip(specs, results, strict=False):
        key = (spec["model"], spec.get("long_prompt", False), spec.get("metrics"))
        if key not in references:
            references[key] = cp_run({**spec, "plan": None})
        assert_same(spec, got, references[key])
    masked_mean, hand, evaluated = results[len(specs) :]
    assert "cannot cut this loss" in masked_mean.get("refused", ""), masked_mean
    assert "returns a mean" in masked_mean["refused"]
    assert "cannot cut this model's sequences" in hand.get("refused", ""), hand
    assert "the first module whose output departs is blocks.0.out (Linear)" in hand["refused"]
    assert "blocks.0.out (Linear)" in evaluated.get("refused", ""), evaluated


@pytest.mark.slow
def test_a_cp_checkpoint_resumes_in_one_process_and_under_fsdp_and_verify_says_same(
    tmp_path,
) -> None:
    """A checkpoint saved under cp=2 after two steps continues in one process and under
    fsdp=2 as the uninterrupted one-process run does (parameters are whole on every cp
    rank; DCP reshards for FSDP2); mf.verify --plan cp=2 reads "same run"."""
    from context import cp_save_then_resume, gpt_loss, meshfit_gpt

    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = mf.launch(cp_save_then_resume, nproc=2, args=(path, "cp=2", True))
        alone = cp_save_then_resume(path, None, False)
        sharded = mf.launch(cp_save_then_resume, nproc=2, args=(path, "fsdp=2", False))
        report = mf.verify(meshfit_gpt, "cp=2", batch_of("gpt", "pair", 0), loss_fn=gpt_loss)
    whole = cp_run({"model": "gpt", "plan": None})["losses"]
    assert first == pytest.approx(whole[:2], rel=RTOL)
    assert alone == pytest.approx(whole[2:], rel=RTOL)
    assert sharded == pytest.approx(whole[2:], rel=RTOL)
    assert report.ok and report.verdict == "same run", report


def test_packed_rows_keep_documents_apart() -> None:
    """mf.data.pack: each document starts a row's positions again, its first token is
    not predicted from the previous document, padding is masked; a transformers Llama on
    the packed rows gives each document's tokens the logits it gives the document alone
    (meshfit passes use_cache=False, without which transformers let them attend across:
    0.06 apart), and the packed rows' loss is the documents' token mean."""
    rows = mf.data.pack([[1, 2, 3], [4, 5, 6, 7, 8], [9]], 8)
    assert [r["position_ids"].tolist() for r in rows] == [
        [0, 1, 2, 0, 1, 2, 3, 4],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]
    assert rows[0]["labels"].tolist() == [-100, 2, 3, -100, 5, 6, 7, 8]
    assert rows[1]["labels"].tolist() == [-100] * 8
    torch.manual_seed(0)
    model = llama().double()
    docs = documents(0, 6)
    batch = mf.data.stack(mf.data.pack(docs, LENGTH))
    engine = mf.parallelize(model, None, loss_fn="model")
    packed = float(engine.evaluate(batch))
    total = count = 0.0
    for doc in docs:
        ids = torch.tensor([doc])
        out = model(input_ids=ids, labels=ids)
        total += float(out.loss) * (len(doc) - 1)
        count += len(doc) - 1
    assert packed == pytest.approx(total / count, rel=1e-6)  # the loss sums in float32


def test_a_sequence_cp_cannot_cut_is_refused_naming_the_fix() -> None:
    """A sequence that does not cut into 2 x cp chunks is refused in one line naming
    the fix (called as the runner calls it: one process runs no cut; prediction under cp
    is refused in the cp=2 launch above)."""
    from meshfit.parallel.context.chunks import check_length

    check_length(16, 4)
    with pytest.raises(mf.MeshfitError, match="multiple of 8 .*mf.data.pack"):
        check_length(12, 4)
