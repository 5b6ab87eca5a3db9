"""Losses that couple the samples of a batch (meshfit/coupling/): a contrastive loss over
in-batch pairs, a mixture of experts' load-balancing loss, a user's own. Under a plan
that splits the batch each is made global (the one-process run), or refused in one line
naming what couples; the zoo (test_model_zoo.py) runs CLIP, SigLIP, sentence pairs and
Qwen3-MoE / Mixtral with their load-balancing loss under every plan."""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from coupled import (  # noqa: E402
    centered_mlp,
    coupled_run,
    many_coupled_runs,
    many_pipeline_coupled_runs,
    pipeline_coupled_run,
    plain_mlp,
    round_order,
    summed_loss,
    vectors,
    worst_sample_loss,
)
from helpers import tolerance  # noqa: E402
from zoo import FAMILIES, zoo_optimizer  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.coupling import moe  # noqa: E402
from meshfit.coupling.scope import Scope, active  # noqa: E402
from meshfit.verification.run import weight_differences  # noqa: E402

FLOAT32 = 1e-5  # the zoo's float32 bar (measured: 1.4e-7 at most)


def distance(got: dict, ref: dict) -> float:
    """The largest relative difference of a step's loss or a weight tensor (weights as
    the zoo compares them: a tensor that holds only rounding noise, as a key bias does,
    against the model's typical weight)."""
    losses = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True)]
    return max([*losses, *weight_differences(got["state"], ref["state"]).values()])


def assert_same_run(got: dict, ref: dict, rtol: float | None = None) -> None:
    rtol = rtol or tolerance(next(iter(ref["state"].values())).dtype)
    assert distance(got, ref) <= rtol, (distance(got, ref), got["losses"], ref["losses"])


# ---- one process ---------------------------------------------------------------------


def test_the_load_balancing_loss_is_transformers_own_bit_for_bit() -> None:
    """meshfit's version of load_balancing_loss_func, in one process (nothing to sum
    over), computes transformers' value exactly, with and without a padding mask."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as library

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(24, 4, generator=g, requires_grad=True) for _ in range(3))
    mask = (torch.rand(3, 8, generator=g) > 0.3).long()
    mine = moe._global_version(library.load_balancing_loss_func, "library")
    for attention_mask in (None, mask):
        theirs = library.load_balancing_loss_func(logits, 4, 2, attention_mask)
        with active(Scope()):
            ours = mine(logits, 4, 2, attention_mask)
        assert torch.equal(ours, theirs)
        (grad_ours,) = torch.autograd.grad(ours, logits[0])
        (grad_theirs,) = torch.autograd.grad(theirs, logits[0])
        assert torch.equal(grad_ours, grad_theirs)
    assert mine(logits, 4, 2, None) == library.load_balancing_loss_func(logits, 4, 2, None)


def test_a_moe_models_own_loss_is_the_one_transformers_computes() -> None:
    """loss_fn="model" sums the token losses and divides by the global count (exact
    under any plan); the load-balancing term the model adds to that sum was divided by
    the token count too, so its weight shrank by the number of tokens, silently. Now the
    loss is the model's: token mean + coefficient x load-balancing loss."""
    family = FAMILIES["qwen3_moe_aux"]
    torch.manual_seed(1234)
    model = family.build()
    batch = family.batch(8, 0)
    theirs = model(**batch)
    assert theirs.aux_loss > 0
    torch.manual_seed(1234)
    engine = mf.parallelize(family.build(), None, loss_fn="model", optimizer=torch.optim.SGD)
    ours = float(engine.step(batch))
    assert ours == pytest.approx(float(theirs.loss.detach()), rel=FLOAT32)
    token_mean = float((theirs.loss - 0.02 * theirs.aux_loss).detach())
    assert abs(ours - token_mean) > 100 * FLOAT32 * ours  # the aux term counts in full


def test_the_helpers_return_their_input_outside_a_step() -> None:
    x = torch.randn(4, 3)
    assert mf.gather_batch(x) is x and mf.batch_sum(x) is x


def test_a_module_that_mixes_samples_is_refused_naming_it() -> None:
    """One process with two micro-batches splits the batch as data parallel does: a
    module that subtracts the batch's mean (no BatchNorm) makes each micro-batch's
    samples depend on each other. Refused at the first step, before any update, naming
    the module; the weights are untouched."""
    model = centered_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = mf.parallelize(model, "microbatches=2", loss_fn=F.cross_entropy)
    with pytest.raises(mf.MeshfitError) as refusal:
        engine.step(vectors())
    message = str(refusal.value)
    assert "the loss couples the samples of a batch" in message and "\n" not in message
    assert "1 (BatchCentered)" in message and "mf.gather_batch" in message
    assert "2 micro-batches" in message
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_coupling_in_training_only_is_found_after_an_evaluation() -> None:
    """The probe runs at the first evaluation if one comes first, in evaluation mode,
    where this module keeps the samples apart; it runs again at the first training step
    (before, it ran once: the module's training forward then mixed each micro-batch's
    samples with no word, another run than one process)."""
    engine = mf.parallelize(centered_mlp(in_training_only=True), "microbatches=2",
                            loss_fn=F.cross_entropy)  # fmt: skip
    engine.evaluate(vectors())
    with pytest.raises(mf.MeshfitError, match="first module whose output .* 1 .TrainingCentered"):
        engine.step(vectors())


def test_a_loss_that_is_neither_a_mean_nor_a_sum_of_its_samples_is_refused() -> None:
    engine = mf.parallelize(plain_mlp(), "microbatches=2", loss_fn=worst_sample_loss)
    with pytest.raises(mf.MeshfitError, match="the loss function mixes them"):
        engine.step(vectors())


def test_a_loss_that_sums_its_samples_trains_the_one_process_run() -> None:
    """reduction="sum" (here divided by a constant) is no coupling: the parts' sums add
    up to the batch's. Before, two micro-batches refused it as a coupled loss (and a
    pipeline divided it by its micro-batch count with no word: the worker test below)."""

    def run(plan: str | None) -> dict:
        engine = mf.parallelize(plain_mlp(), plan, loss_fn=summed_loss)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            losses = [float(engine.step(vectors(seed=s))) for s in range(3)]
        return {"losses": losses, "state": engine.full_state_dict(), "said": out.getvalue()}

    one, parts = run(None), run("microbatches=2")
    assert_same_run(parts, one)
    assert "the loss is a sum over the samples" in parts["said"], parts["said"]


def test_a_mean_over_samples_with_ignored_targets_is_not_warned_of() -> None:
    """wav2vec2's CTC loss with ctc_loss_reduction="mean" (as Hugging Face's speech
    recipes set it) averages each transcript's loss over the samples: exact however the
    batch is split, though its labels hold -100 padding. Two micro-batches warned that a
    mean over -100 targets "weighs the real tokens of each part by that part's count";
    the probe now sees the plain mean hold with uneven counts and says nothing. A mean
    over the tokens is trained exactly too."""
    from coupled import wav2vec2_batch, wav2vec2_ctc

    def run(plan: str | None, loss: object = "model") -> tuple[list[float], list[str]]:
        model = wav2vec2_ctc().double()
        model.config.ctc_loss_reduction = "mean"
        engine = mf.parallelize(model, plan, loss_fn=loss)
        batches = [_doubled(wav2vec2_batch(8, s)) for s in range(2)]
        if loss != "model":  # (inputs, targets): the labels as the targets
            batches = [
                ({k: v for k, v in b.items() if k != "labels"}, b["labels"]) for b in batches
            ]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [float(engine.step(batch)) for batch in batches]
        return losses, [str(w.message) for w in caught if "-100" in str(w.message)]

    (one, _), (parts, said) = run(None), run("microbatches=2")
    assert parts == pytest.approx(one, rel=1e-6) and not said, (parts, one, said)

    def token_mean(outputs: object, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits[:, : labels.shape[1]]
        return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)

    # a mean over the tokens: the probe finds it a mean over the real targets and
    # meshfit trains it as (mean x count, count), the one-process run with nothing to say
    # (before, warned of and a different run)
    (one, _), (parts, said) = run(None, token_mean), run("microbatches=2", token_mean)
    assert parts == pytest.approx(one, rel=1e-6) and not said, (parts, one, said)


def _doubled(batch: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def test_a_mean_left_undecided_is_warned_of_over_minus_100_and_over_the_pad_id() -> None:
    """Where the probe tells no mean over the real targets (a model near uniform: every
    weighting gives nearly one loss), the first step warns that a mean over ignored
    targets differs once the batch is split. Labels padded with the pad id (a script's
    ignore_index=pad_id) went unwarned: only -100 was looked for."""
    from types import SimpleNamespace

    from meshfit.runtime.batch_errors import warn_on_ignored_targets

    def warned(targets: torch.Tensor, parts: int = 2) -> list[str]:
        plan = SimpleNamespace(num_microbatches=parts)
        topology = SimpleNamespace(batch_parts=parts, dp_size=1, plan=plan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_on_ignored_targets(targets, topology)
        return [str(w.message) for w in caught]

    ids = torch.tensor([[5, 7, 9, 0, 0], [4, 8, 0, 0, 0], [3, 6, 2, 8, 1]])
    (said,) = warned(ids)  # the pad id 0
    assert "padded with 0" in said and "cross_entropy(ignore_index=0)" in said, said
    (said,) = warned(ids.masked_fill(ids == 0, -100))
    assert "hold -100" in said and "cross_entropy(ignore_index=-100)" in said, said
    assert warned(ids, parts=1) == []  # one part: nothing is weighed apart
    assert warned(torch.tensor([[5, 7, 9], [4, 8, 1]])) == []  # no padding
    assert warned(torch.tensor([1, 1, 1, 0])) == []  # class labels
    # one row of three ending in a repeated token: a coincidence of the text, not padding
    assert warned(torch.tensor([[5, 7, 9, 9], [4, 8, 1, 2], [3, 6, 2, 8]])) == []


def test_a_loss_is_told_from_its_halves_a_sum_a_token_mean_or_neither() -> None:
    """coupling/halves.py on the loss function alone (a pipeline's last stage asks it so):
    a sum adds up, a mean over the real targets is the halves' count-weighted mean (counted
    after each row's first where the loss shifts the labels itself), a plain mean is
    neither; where no split of the rows holds shares of the real targets other than its
    shares of the rows the two means cannot be told apart (warned of), and a pair or a
    loss that cannot take halves is left as it is."""
    from meshfit.coupling.halves import Kind, explained, kind, padding_fields
    from meshfit.losses import _decided_from_halves

    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (4, 6))
    uneven = labels.clone()
    uneven[0, :4] = -100  # the first half holds 8 real targets, the second 12
    even = labels.clone()
    even[0, :4], even[2, :4] = -100, -100  # 8 and 8 in the halves, 2 and 14 after row 0
    padded = labels.clone()  # a collator's labels: the ids, -100 at the padding only
    padded[0, 3:], padded[1, 5:] = -100, -100

    def ce(reduction: str):
        return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction=reduction)

    def shifting(out, y):  # the loss most causal-LM scripts write
        return F.cross_entropy(out[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    def asked(loss_fn, targets, rows=slice(None)):
        out, y = logits[rows], targets[rows]
        return _decided_from_halves(loss_fn, out, y, loss_fn(out, y))

    assert asked(ce("sum"), uneven) == Kind(summed=True)
    assert asked(ce("mean"), uneven) == Kind(counted=True)
    assert asked(ce("mean"), padded) == Kind(counted=True)
    assert asked(shifting, padded) == Kind(counted=True, shifted=True)
    assert asked(ce("mean"), even) == Kind(counted=True)
    assert asked(ce("mean"), even, [0, 2]) == Kind()  # 2 and 2: no split tells
    assert asked(lambda out, y: out.square().mean(), uneven) == Kind(per_sample=True)
    assert asked(lambda out, y: (out.sum(), torch.tensor(4.0)), uneven) == Kind()
    assert asked(lambda out, y: out.view(4, 66).sum(), uneven) == Kind()  # 4 rows only
    assert asked(ce("sum"), uneven, [0]) == Kind(summed=True)  # one sample, given twice
    # a script's own padding: labels padded with the pad id (0), ignore_index=0
    ids = torch.randint(1, 11, (4, 6))
    ids[0, 3:], ids[1, 4:] = 0, 0

    def ignoring_pad(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=0)

    def shifting_pad(out, y):
        return F.cross_entropy(out[:, :-1].flatten(0, 1), y[:, 1:].flatten(), ignore_index=0)

    assert asked(ignoring_pad, ids) == Kind(counted=True, ignored=0)
    assert asked(shifting_pad, ids) == Kind(counted=True, shifted=True, ignored=0)

    def laid(summed, plain, counted, shifted, padding=None, padded=None):
        """distances' layout: a padding's countings as given, else the plain mean's."""
        padded = padded or ((plain, 0.0), (plain, 0.0))
        fields = padding_fields(padding)
        return (summed, plain, *fields, *counted, *shifted, *padded[0], *padded[1])

    # a model near uniform (every token's loss about log(vocabulary)): the distances a
    # small Llama's first 2 and 4 samples gave, the shifting loss on a collator's labels;
    # the nearer count wins where both are within float32's limit, and the plain mean
    # within it too loses where it is clearly farther; in low precision (no floor given)
    # the plain mean must be beyond the limit, else neither (warned of)
    near_uniform = [
        laid(1.0, 1.8e-4, (1.8e-5, 1.0), (2.3e-8, 1.0)),
        laid(1.0, 1.8e-5, (1.9e-6, 1.0), (6.3e-8, 1.0)),
    ]
    for off in near_uniform:
        assert kind(off, 2e-5, 1e-6) == Kind(counted=True, shifted=True)
    assert kind(near_uniform[1], 2e-2) == Kind()
    assert kind(laid(1.0, 3e-8, (3e-3, 1.0), (3e-3, 1.0)), 2e-5, 1e-6) == Kind(per_sample=True)
    assert kind(laid(1.0, 8e-7, (5e-7, 1.0), (5e-7, 1.0)), 2e-5, 1e-6) == Kind()  # no telling
    # the padding counted only where every rank that found padding found the same (the
    # largest of it and of its negation one value): else a mean over it is not told, and
    # the probe's difference keeps the plain mean's
    padded = ((1e-8, 1.0), (3e-3, 1.0))
    agreed = laid(1.0, 3e-3, (3e-3, 0.0), (3e-3, 0.0), padding=0, padded=padded)
    assert kind(agreed, 2e-5, 1e-6) == Kind(counted=True, ignored=0)

    def with_a_rank_that_found(padding: int | None) -> list[float]:
        fields = padding_fields(padding)
        return [*agreed[:2], max(agreed[2], fields[0]), max(agreed[3], fields[1]), *agreed[4:]]

    apart = with_a_rank_that_found(5)
    assert kind(apart, 2e-5, 1e-6) == Kind() and explained(apart) == 1e9
    # a rank that found none (its rows all full) agrees with any: it was refused as
    # coupled before, the plain mean's difference kept
    assert kind(with_a_rank_that_found(None), 2e-5, 1e-6) == Kind(counted=True, ignored=0)
    assert kind(laid(1.0, 3e-3, (3e-3, 0.0), (3e-3, 0.0), padded=padded), 2e-5, 1e-6) == Kind()


def test_the_first_mixing_module_is_found_where_a_later_write_changes_an_output() -> None:
    """The probe's search for the module where samples start to mix compared outputs it
    kept as views until the comparison; wav2vec2's encoder zeroes the padded frames of
    the feature projection's output in place afterwards, and the search blamed that
    Linear (a sum loss over per-sample modules was refused "the first module whose
    output for a sample depends on the others is wav2vec2.feature_projection.projection
    (Linear)"). Now every module of it is per sample: none is named."""
    from coupled import wav2vec2_batch, wav2vec2_ctc

    from meshfit.coupling.probe import _first_mixing_module

    model = wav2vec2_ctc().double()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in wav2vec2_batch(4).items()}

    def run_loss(inputs: dict, _targets: object) -> tuple:
        return model(**inputs).loss, None

    def scope(**_kwargs: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(type("Scope", (), {"met": set()})())

    assert _first_mixing_module(model, run_loss, scope, batch, None, 4, None) is None


def test_batchnorm_dropout_and_masked_means_are_not_couplings() -> None:
    """What meshfit handles already passes the probe: BatchNorm (made global by meshfit
    itself), dropout (held still while the probe runs) and a mean over targets with
    ignored entries (a weighting, warned of, not a coupling)."""
    x, y = vectors()
    y[::3] = -100

    def masked(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets, ignore_index=-100)

    for model, loss in (
        (plain_mlp(batchnorm=True), F.cross_entropy),
        (plain_mlp(dropout=0.3), F.cross_entropy),
        (plain_mlp(), masked),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the masked mean's warning
            engine = mf.parallelize(model, "microbatches=2", loss_fn=loss, sync_batchnorm=False)
            engine.step((x, y))
        verdict = engine.coupling.verdict
        assert verdict is not None and not verdict.coupled, (model, verdict)


def test_in_batch_products_are_found_and_the_micro_batches_said() -> None:
    """A loss over in-batch pairs under two micro-batches in one process: the probe
    finds the product, and fit's start-up says that the loss is formed per micro-batch
    (the one-process run with microbatches=2, not with one)."""
    family = FAMILIES["sentence_pairs"]
    torch.manual_seed(1234)
    engine = mf.parallelize(
        family.build().double(), "microbatches=2", loss_fn=family.loss(), optimizer=torch.optim.SGD
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine.step(family.batch(8, 0))
    said = out.getvalue()
    assert "the loss couples the samples of a batch (in-batch products)" in said, said
    assert "formed per micro-batch (one at a time)" in said, said
    assert engine.coupling.scope.products


def test_a_drop_path_drawing_with_rand_is_held_still_by_the_probe() -> None:
    """transformers' drop path (ConvNextDropPath, SwinDropPath, ...: `keep +
    torch.rand(shape)`, floored) draws one number per sample, not with bernoulli_: the
    probe's pass over the second half drew the first half's numbers, and the plan was
    refused naming the drop path as the module that mixes samples (Mask2Former's Swin
    backbone under dp=2). Its drop_prob is held at 0 in the probe's passes (and given
    back)."""
    from transformers.models.convnext.modeling_convnext import ConvNextDropPath

    torch.manual_seed(5)
    layers = [torch.nn.Linear(8, 16), ConvNextDropPath(0.5), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 5)).double()
    engine = mf.parallelize(model, "microbatches=2", loss_fn=F.cross_entropy)
    assert math.isfinite(float(engine.step(vectors())))
    assert model[1].drop_prob == 0.5


def test_a_model_that_draws_random_numbers_in_training_is_not_read_as_coupled() -> None:
    """Phi-3.5-MoE (transformers' PhiMoE) draws in training: Gumbel samples pick each
    token's expert, a coin of Heun's method weighs it. A draw over the whole batch and
    one over a half give a sample other numbers, and the probe read that as a coupling:
    the plan was refused, blaming the loss function ("every module's output is per
    sample, so the loss function mixes them"). The probe holds element-wise draws at one
    value now, and the plan trains, saying where the model draws. The control: the same
    model with a loss that does couple its samples (each sample's logits centred on the
    batch's mean) is refused."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        max_position_embeddings=64, attention_dropout=0.0,
        initializer_range=0.2,  # experts apart enough for the draws to show (float32)
    )  # fmt: skip
    x, y = FAMILIES["llama"].batch(8, 0)
    causal = mf.losses.cross_entropy(shift=True)

    def centred(outputs, targets):  # each sample's logits less the batch's mean
        logits = outputs.logits
        return causal(logits - logits.mean(dim=0, keepdim=True), targets)

    torch.manual_seed(0)
    engine = mf.parallelize(
        PhimoeForCausalLM(config), "microbatches=2", loss_fn=causal, optimizer=zoo_optimizer
    )
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert math.isfinite(float(engine.step((x, y))))
    # and start-up says so, naming where its code draws (the router's jitter and Gumbel
    # samples): each part of the batch draws its own, as with dropout
    assert "the model draws random numbers in its training forward (Tensor." in said.getvalue()
    assert "modeling_phimoe.py:" in said.getvalue()
    torch.manual_seed(0)
    engine = mf.parallelize(
        PhimoeForCausalLM(config), "microbatches=2", loss_fn=centred, optimizer=zoo_optimizer
    )
    with pytest.raises(mf.MeshfitError, match="the loss couples the samples of a batch"):
        engine.step((x, y))


def test_a_coupling_inside_a_library_model_names_fixes_the_user_can_apply() -> None:
    """RT-DETR pads its denoising queries to the batch's largest box count inside its
    forward: a coupling in transformers' code. The refusal named it but advised
    "Gather what couples with mf.gather_batch(x)", an edit of code that is not the
    user's; it now says whose code it is and the fixes a user has (a plan that keeps the
    batch whole, or a configuration that keeps the samples apart). A user's own module
    keeps the gather advice (test_a_module_that_mixes_samples_is_refused_naming_it).
    Its label and box noise held still (the probe holds element-wise draws), the first
    four images' outputs are their own (the first half holds the largest box count) and
    the coupling is its loss's (boxes counted and matched over the batch): named so.
    Before, the noise drawn over other shapes named the class embedding. Its own loss
    over the batch meshfit gathers fails inside its matcher: that attempt's failure is
    not reported as the user's batch (it was, "give batches the model ... take")."""
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    backbone = RTDetrResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 1, 1],
        out_features=["stage1", "stage2", "stage3"],
    )  # fmt: skip
    config = RTDetrConfig(
        backbone_config=backbone, d_model=16, encoder_hidden_dim=16,
        encoder_in_channels=[8, 16, 16], feat_strides=[4, 8, 16], encoder_layers=1,
        encoder_ffn_dim=32, encoder_attention_heads=2, decoder_layers=2, decoder_ffn_dim=32,
        decoder_attention_heads=2, num_queries=5, num_labels=4, num_denoising=4,
        decoder_in_channels=[16, 16, 16], decoder_n_points=2, num_feature_levels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    engine = mf.parallelize(
        RTDetrForObjectDetection(config),
        "microbatches=2",
        loss_fn="model",
        sync_batchnorm=False,  # its backbone's BatchNorm: per micro-batch, as asked
    )
    with pytest.raises(mf.MeshfitError) as refusal:
        engine.step(FAMILIES["detr"].batch(8, 0))
    message = str(refusal.value)
    assert "every module's output is per sample, so the loss function mixes them" in message
    assert "It is transformers' code (loss_fn='model')" in message, message
    assert "mf.gather_batch" not in message and "\n" not in message


def test_an_object_detector_trains_its_own_loss_on_its_collators_batch() -> None:
    """YOLOS (DETR's loss: each image's boxes matched to its queries, divided by the
    batch's box count) on the batch its collator yields, `labels` a list of one dict of
    boxes per image. It was refused in one process ("the tensors in inputs disagree on
    the batch size"). Now one process trains the model's own loss; two micro-batches
    take their images with their own boxes (each half's loss as the model computes it
    alone), the loss formed per micro-batch and said (coupling/own_loss.py: under dp
    the same loss is formed over the ranks' gathered batch, test_model_zoo)."""
    family = FAMILIES["yolos"]
    batch = family.batch(8, 0)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return family.build()

    model = build()
    with torch.no_grad():
        whole = float(model(**batch).loss)
        halves = [
            float(model(pixel_values=batch["pixel_values"][a:b], labels=batch["labels"][a:b]).loss)
            for a, b in ((0, 4), (4, 8))
        ]
    assert abs(sum(halves) / 2 - whole) / whole > 1e-3  # coupled: the halves differ
    for plan, expected in ((None, whole), ("microbatches=2", sum(halves) / 2)):
        engine = mf.parallelize(build(), plan, loss_fn="model", optimizer=zoo_optimizer)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            first = float(engine.step(batch))
        assert first == pytest.approx(expected, rel=1e-6), (plan, first, expected)
        if plan:
            assert "the model's own loss over the gathered batch" in out.getvalue()


# ---- worker processes ----------------------------------------------------------------


@pytest.mark.slow
def test_coupled_losses_train_the_one_process_run_and_the_controls_do_not() -> None:
    """Under dp=2 with two micro-batches per rank, CLIP's own contrastive loss and
    Qwen3-MoE's load-balancing loss are formed per round of micro-batches (the m-th of
    both ranks together): the one-process run with microbatches=2 on the rows in that
    order. In-batch negatives written with mf.gather_batch train the one-process run.
    An evaluation before the first step gives one process's loss (in-batch negatives,
    CLIP). Controls: the load-balancing statistics of each rank's own tokens (the run
    before this change) and the in-batch products left per rank (no probe) train other
    runs; a module that mixes samples is refused on every rank alike."""
    order = round_order(8, ranks=2, microbatches=2)
    rounds = "dp=2,microbatches=2"
    specs = [
        {"model": "clip", "plan": rounds},
        {"model": "qwen3_moe_aux", "plan": rounds},
        {"model": "sentence_pairs", "plan": "dp=2", "loss": "gathered"},
        {"model": "qwen3_moe_aux", "plan": "dp=2", "local_balancing": True},
        {"model": "sentence_pairs", "plan": "dp=2", "no_probe": True},
        # an evaluation before any step: the probe runs there (before, each rank formed
        # the coupled loss of its own samples: 1.997 against one process's 2.669)
        {"model": "sentence_pairs", "plan": "dp=2", "evaluate_first": True},
        {"model": "clip", "plan": "dp=2", "evaluate_first": True},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_coupled_runs, nproc=2, args=(specs,))
        refused = mf.launch(_refused_under_dp, nproc=2)
        clip, moe_rounds, gathered, local, per_rank, *evaluated = results
        for spec, got in zip(specs[-2:], evaluated, strict=True):
            assert_same_run(got, coupled_run({**spec, "plan": None}))
        assert_same_run(
            clip, coupled_run({"model": "clip", "plan": "microbatches=2", "order": order})
        )
        moe_reference = coupled_run(
            {"model": "qwen3_moe_aux", "plan": "microbatches=2", "order": order}
        )
        assert_same_run(moe_rounds, moe_reference, FLOAT32)
        assert_same_run(gathered, coupled_run({"model": "sentence_pairs", "loss": "in_batch"}))
        moe_alone = coupled_run({"model": "qwen3_moe_aux"})
        pairs_alone = coupled_run({"model": "sentence_pairs"})
    assert distance(local, moe_alone) > 10 * FLOAT32, distance(local, moe_alone)
    first = abs(per_rank["losses"][0] - pairs_alone["losses"][0]) / pairs_alone["losses"][0]
    assert first > 1e-2, (per_rank["losses"], pairs_alone["losses"])
    assert "1 (BatchCentered)" in refused and "\n" not in refused, refused


def _refused_under_dp() -> str:
    engine = mf.parallelize(centered_mlp(), "dp=2", loss_fn=F.cross_entropy)
    try:
        engine.step(vectors())
    except mf.MeshfitError as refusal:
        return str(refusal)
    return "trained"


def test_a_refusal_shows_the_two_losses_apart() -> None:
    """Two losses that differ below the 6th digit are printed with the digits that show
    it (they once read as the same number in the refusal)."""
    from meshfit.coupling.batch import distinct

    assert distinct(2.5, 1.25) == ("2.5", "1.25")
    assert distinct(1.0000001, 1.0000002) == ("1.0000001", "1.0000002")
    assert distinct(3.0, 3.0) == ("3", "3")


@pytest.mark.slow
def test_losses_that_sum_their_samples_train_the_one_process_run_under_every_plan() -> None:
    """A loss_fn with reduction="sum" and wav2vec2's own CTC loss (a sum: its config's
    default) under dp, fsdp and pp (1-sample micro-batches too): the one-process run.
    Before, pp divided them by its micro-batch count with no word (wav2vec2: 106.4
    where one process has 425.7); the control keeps that behaviour and must differ. A
    forward whose loop adds each block's input to its output is refused under pp (a
    stage receives only what the block before it returned: it trained 4% apart), and so
    is one that runs its whole stack twice (the later stage ran its blocks in both
    loops, the first stage in one: 30% apart with no word). wav2vec2 with LayerDrop trains under dp (before: the probe took its random skips
    for a coupling, and DDP needs to find the layers each rank skipped)."""
    from coupled import many_sum_loss_runs, sum_loss_run

    specs = [
        {"model": "mlp", "plan": "dp=2"},
        {"model": "mlp", "plan": "fsdp=2"},
        {"model": "mlp", "plan": "pp=2"},
        {"model": "mlp", "plan": "pp=2,microbatches=8"},
        {"model": "wav2vec2", "plan": "dp=2"},
        {"model": "wav2vec2", "plan": "pp=2"},
        {"model": "mlp", "plan": "pp=2", "undecided": True},
        {"model": "loop_residual", "plan": "pp=2"},
        {"model": "looped_stack", "plan": "pp=2"},
        {"model": "wav2vec2", "plan": "dp=2", "layerdrop": 0.5},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_sum_loss_runs, nproc=2, args=(specs,))
        mlp, wav2vec2 = sum_loss_run({"model": "mlp"}), sum_loss_run({"model": "wav2vec2"})
    *trained, control, looped, twice, layerdrop = results
    for spec, got in zip(specs, trained, strict=False):
        # wav2vec2's CTC loss is computed in float32 inside the float64 model
        ref, rtol = (wav2vec2, FLOAT32) if spec["model"] == "wav2vec2" else (mlp, None)
        assert "refused" not in got, (spec, got["refused"])
        assert_same_run(got, ref, rtol)
    assert distance(control, mlp) > 0.5, control["losses"]
    refusal = looped.get("refused", "")
    assert "block 1 of 'blocks' an input made from block 0's input" in refusal, looped
    refusal = twice.get("refused", "")
    assert "calls block 0 of 'blocks' again after block 3 in one forward" in refusal, twice
    # LayerDrop: each rank skips other layers at random (no one-process run to match);
    # DDP finds the unused parameters from the start, and the probe's passes draw alike
    assert "refused" not in layerdrop and all(map(math.isfinite, layerdrop["losses"])), layerdrop


@pytest.mark.slow
def test_under_pp_a_coupling_is_found_before_the_cut_or_at_the_first_pass() -> None:
    """The probe cannot run under a pipeline schedule (its stages run whole
    micro-batches): before, a block that subtracts the batch's mean and a loss of the
    batch's worst sample trained each micro-batch on its own under pp=2 (4 micro-batches)
    with no word, another run than one process. The question is asked on the whole
    model before the cut, with the loss where the first batch's targets are known, the
    forward alone where the model is built on example inputs: refused in one line. Where
    that question cannot see it (the loss of a model built on example inputs, before any
    target; anything in a model built on meta, which has no values before the cut), the
    first pass asks what its stages ran (coupling/stages.py): the loss on the last
    stage, each stage module of a meta model. With one micro-batch under GPipe the batch
    runs whole: the one-process run."""
    specs = [
        {"plan": "pp=2", "centered": True},
        {"plan": "pp=2", "loss": "worst"},
        {"plan": "pp=2", "centered": True, "eager": True},
        {"plan": "pp=2", "loss": "worst", "eager": True},
        {"plan": "pp=2", "centered": True, "meta": True},
        {"plan": "pp=2", "loss": "worst", "meta": True, "again": True},
        {"plan": "pp=2,microbatches=1,schedule=gpipe", "loss": "worst"},
        {"plan": "pp=2,microbatches=1,schedule=gpipe", "centered": True},
        {"plan": "pp=2"},  # control: a mean over the samples trains
        {"plan": "pp=2", "meta": True},  # control: the meta model's stages ask, and train
    ]
    results = mf.launch(many_pipeline_coupled_runs, nproc=2, args=(specs,))
    centered, worst, eager, eager_worst, meta_centered, meta_worst = results[:6]
    for got in (eager_worst, meta_worst):
        assert "so the loss function mixes them" in got.get("refused", ""), got
        assert "the weights are as they were" in got["refused"], got
    assert "is blocks.2.centered (BatchCentered)" in meta_centered.get("refused", ""), meta_centered
    # refused after the pass, before the optimizer step; the step tried again asks again
    assert meta_worst["kept"] and meta_worst["again"] == meta_worst["refused"], meta_worst
    assert "first module whose output for a sample depends on the others is blocks.2" in (
        centered.get("refused", "")
    ), centered
    assert "over 4 micro-batches" in centered["refused"] and "\n" not in centered["refused"]
    assert "pp=N,microbatches=1,schedule=gpipe" in centered["refused"]
    assert "so the loss function mixes them" in worst.get("refused", ""), worst
    assert "blocks.2" in eager.get("refused", ""), eager
    for spec, got in zip(specs[6:], results[6:], strict=True):
        assert_same_run(got, pipeline_coupled_run({**spec, "plan": None}))
