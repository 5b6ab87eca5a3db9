"""Buffers a training forward updates from the samples it sees (meshfit/coupling/
statistics.py): a VQ-VAE's codebook averages, I-BERT's activation ranges. Under a plan
that splits the batch each rank would update them from its own share: refused in one
line where the forward reads them (a codebook), said at start-up where it does not."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

pytest.importorskip("transformers")

from coupled import (  # noqa: E402
    VQAutoencoder,
    ibert_masked_lm,
    many_vq_runs,
    masked_batch,
    vq_loss,
    vq_run,
)
from test_coupling import assert_same_run, distance  # noqa: E402

import meshfit as mf  # noqa: E402


def test_a_codebook_updated_from_the_batch_is_refused_naming_it() -> None:
    """One process with micro-batches splits the batch as ranks do: the codebook's
    averages (read by the next forward) would follow each micro-batch's share. Refused
    before any update, naming the buffers and the fixes (not mf.gather_batch, which
    crosses ranks, not micro-batches run one after another), and the model's buffers
    left as they were: the probe restores even the one the forward replaces
    (`cluster_size`), which copying into the saved tensors did not. The step count is no
    statistic of the batch and is not named."""
    torch.manual_seed(0)
    model = VQAutoencoder().double()
    before = {name: b.clone() for name, b in model.named_buffers()}
    engine = mf.parallelize(model, "microbatches=2", loss_fn=vq_loss)
    x = torch.randn(8, 8, dtype=torch.float64)
    with pytest.raises(mf.MeshfitError) as refusal:
        engine.step((x, x))
    message = str(refusal.value)
    assert message.startswith("buffer 'vq.embed' (and 2 more: vq.cluster_size, vq.embed_avg)")
    assert "and the forward reads it" in message and "2 micro-batches" in message
    assert "sync_batchnorm=False" in message
    assert "Use microbatches=1 (or a plan that keeps the batch whole" in message
    assert "mf.gather_batch" not in message  # it crosses ranks, not micro-batches
    assert "vq.updates" not in message
    after = dict(model.named_buffers())
    assert all(torch.equal(after[name], b) for name, b in before.items())


def test_an_evaluation_first_leaves_the_question_to_the_first_training_step() -> None:
    """An evaluation's forward updates no buffer: asked there (the coupling probe runs at
    the first step or evaluation, whichever comes first), the question found nothing,
    and the codebook then trained each micro-batch's updates with no word. It is asked
    at the first training step."""
    torch.manual_seed(0)
    engine = mf.parallelize(VQAutoencoder().double(), "microbatches=2", loss_fn=vq_loss)
    x = torch.randn(8, 8, dtype=torch.float64)
    engine.evaluate((x, x))
    with pytest.raises(mf.MeshfitError, match="^buffer 'vq.embed' .* and the forward reads it"):
        engine.step((x, x))


def test_a_statistic_the_loss_does_not_read_is_said_at_start_up() -> None:
    """I-BERT (quant_mode off, its default) keeps the range of its activations in its
    QuantAct modules' buffers, updated in every training forward and read by nothing
    then: the plan trains, and a start-up line names them (its saved ranges will be
    the micro-batches' rather than the batch's). Its loss matches one process's."""
    batch = masked_batch(batch=4)
    losses, said = [], []
    for plan in (None, "microbatches=2"):
        engine = mf.parallelize(ibert_masked_lm().double(), plan, loss_fn="model")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            losses.append(float(engine.step(batch)))
        said.append(out.getvalue())
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)
    assert "embeddings_act1" not in said[0]  # one process: nothing to say
    assert "buffer 'ibert.embeddings.embeddings_act1.x_max' (and 46 more" in said[1]
    assert "the loss does not read it" in said[1]
    assert "draws random numbers" not in said[1]  # dropout off; it draws nothing else


@pytest.mark.slow
def test_batch_statistics_under_dp_fsdp_and_pp() -> None:
    """The codebook under dp=2 and fsdp=2: refused as it stands; with its update computed
    from mf.gather_batch (the refusal's fix) the one-process run, buffers included; and
    under sync_batchnorm=False (each rank keeps its own, as asked) another run than one
    process's: what the refusal guards against. Under pp=2 the same, asked before the
    cut, or, for a model built on meta, of each stage at the first pass."""
    reference, stacked = vq_run({}), vq_run({"model": "stack"})
    ibert = vq_run({"model": "ibert"})
    specs = [
        {"plan": "dp=2"},
        {"plan": "fsdp=2"},
        {"plan": "dp=2", "gather": True},
        {"plan": "fsdp=2", "gather": True},
        {"plan": "dp=2", "options": {"sync_batchnorm": False}},
        {"plan": "pp=2", "model": "stack"},
        {"plan": "pp=2,microbatches=1,schedule=gpipe", "model": "stack"},
        {"plan": "pp=2", "model": "stack", "options": {"sync_batchnorm": False}},
        {"plan": "pp=2", "model": "ibert"},
        {"plan": "pp=2", "model": "stack", "eval": True},
        {"plan": "pp=2", "model": "stack", "meta": True},
        {"plan": "pp=2,microbatches=1,schedule=gpipe", "model": "stack", "meta": True},
    ]
    results = mf.launch(many_vq_runs, nproc=2, args=(specs,))
    for result in results[:2]:
        assert result["refused"].startswith("buffer 'vq.embed'"), result
        assert "2 data-parallel ranks" in result["refused"]
        assert "Compute the update from mf.gather_batch(x)" in result["refused"]
    for result in results[2:4]:
        assert_same_run(result, reference)
        assert torch.equal(result["state"]["vq.updates"], reference["state"]["vq.updates"])
    assert distance(results[4], reference) > 1e-3
    # pp: asked before the cut (its micro-batches run one after another); with one
    # micro-batch the one-process run, the cut's check forward and torch's metadata
    # inference leaving the codebook as it was (before, two updates more: 1e-3 apart)
    assert results[5]["refused"].startswith("buffer 'vq.embed'"), results[5]
    assert "over 4 micro-batches" in results[5]["refused"]
    assert "mf.gather_batch" not in results[5]["refused"]
    assert_same_run(results[6], stacked)
    assert torch.equal(results[6]["state"]["vq.updates"], stacked["state"]["vq.updates"])
    assert distance(results[7], stacked) > 1e-3
    # I-BERT under pp=2: its ranges are no statistic it reads (said at start-up) and it
    # trains the one-process run; before, torch's metadata inference gave its second
    # stage torch.empty activations and QuantAct asserted "NaN detected ..."
    # (x_min or x_max first: asked of the first four samples where a micro-batch holds
    # fewer, its halves' ranges and the whole's differ in either)
    assert "buffer 'ibert.embeddings.embeddings_act1.x_m" in results[8]["said"]
    assert "the loss does not read it" in results[8]["said"]
    weights = {name for name, _ in ibert_masked_lm().named_parameters()}

    def trained(run: dict) -> dict:  # the ranges differ, as said: the weights do not
        return {**run, "state": {k: v for k, v in run["state"].items() if k in weights}}

    assert_same_run(trained(results[8]), trained(ibert), rtol=1e-5)
    # a model handed over in evaluation mode (as from_pretrained returns it): asked in
    # training mode (before, the forward updated nothing and the question found nothing)
    assert results[9]["refused"] == results[5]["refused"], results[9]
    # built on meta (no values before the cut): the first pass asks each stage module
    # (coupling/stages.py); before, each micro-batch updated the codebook with no word
    assert results[10]["refused"].startswith("buffer 'vq.embed'"), results[10]
    assert "over 4 micro-batches" in results[10]["refused"], results[10]
    meta_stacked = vq_run({"model": "stack", "meta": True})
    assert_same_run(results[11], meta_stacked)
    assert torch.equal(results[11]["state"]["vq.updates"], meta_stacked["state"]["vq.updates"])


def test_a_buffer_of_infinities_left_alone_is_not_a_statistic() -> None:
    """A mask of -inf kept in a buffer and rewritten alike each forward is no statistic:
    -inf less -inf is NaN, which a plain difference read as changed."""
    from meshfit.coupling.statistics import _same

    mask = torch.full((3, 3), float("-inf")).triu(1)
    assert _same(mask, mask.clone())
    assert not _same(mask, mask.triu(2))
    assert _same(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]))
    assert not _same(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]))
