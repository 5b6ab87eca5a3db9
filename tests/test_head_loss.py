"""`chunked_loss=N`: the LM head's product and the cross-entropy computed N tokens at a
time (parallel/head_loss.py). Every run against the same model with the whole logits in
one process, float64: the chunks change nothing but the memory, under any plan."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from head_loss import head_run, many_head_runs  # noqa: E402
from helpers import tolerance  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.parallel.head_loss import linear_cross_entropy  # noqa: E402
from meshfit.verification.run import weight_differences  # noqa: E402

RTOL = tolerance("float64")
# transformers' token losses cast the logits to float32 (`logits.float()`): the model's
# own loss and the gradient of its logits are float32 in both runs, rounded in another
# order (the whole run's log_softmax backward against the chunks' softmax - one-hot), so
# their values agree to float32's precision, not float64's (measured: 4e-7 and 1.3e-9)
MODEL_LOSS_RTOL = 1e-5
MODEL_WEIGHT_RTOL = 1e-7


def assert_same(spec: dict, got: dict, ref: dict, chunked: bool = True) -> None:
    """got equals ref; got computed its loss in chunks (on some rank) when `chunked`."""
    assert "refused" not in got, (spec, got.get("refused"))
    assert (got["chunked_calls"] > 0) == chunked and ref["chunked_calls"] == 0, spec
    losses = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    weights = max(weight_differences(got["state"], ref["state"]).values())
    own = spec.get("loss") == "model"
    loss_rtol, weight_rtol = (MODEL_LOSS_RTOL, MODEL_WEIGHT_RTOL) if own else (RTOL, RTOL)
    assert losses <= loss_rtol and weights <= weight_rtol, (spec, losses, weights)


def test_the_chunked_product_and_loss_equal_the_whole_with_their_gradients() -> None:
    """The function itself: chunks of 4 over 21 tokens (the last chunk short), ignored
    targets, a bias, an incoming gradient other than 1; and without gradients."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    targets[0, :3] = -100
    whole = F.cross_entropy(
        F.linear(hidden, weight, bias).flatten(0, 1), targets.flatten(), reduction="sum"
    )
    chunked = linear_cross_entropy(hidden, weight, bias, targets, chunk_tokens=4)
    assert abs(float((whole - chunked).detach())) <= 1e-12 * abs(float(whole.detach()))
    expected = torch.autograd.grad(1.7 * whole, (hidden, weight, bias))
    got = torch.autograd.grad(1.7 * chunked, (hidden, weight, bias))
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        assert torch.equal(
            linear_cross_entropy(hidden, weight, bias, targets, chunk_tokens=4), chunked.detach()
        )


def test_the_lean_logsumexp_is_torch_s() -> None:
    # the vocabulary-parallel chunk's log-sum-exp with one temporary: torch's values,
    # a row of -inf and a rank with no words included
    from meshfit.parallel.head_loss import _logsumexp

    z = torch.randn(5, 7, dtype=torch.float64) * 30
    z[1] = float("-inf")
    z[2, 3] = float("inf")
    torch.testing.assert_close(_logsumexp(z), torch.logsumexp(z, dim=-1))
    empty = torch.empty(3, 0)
    torch.testing.assert_close(_logsumexp(empty), torch.logsumexp(empty, dim=-1))


def test_targets_it_cannot_take_are_the_batch_s_not_meshfit_s() -> None:
    """Float ids, ids of another count than the head's tokens, an id outside the
    vocabulary: said as the batch's problem with its fix (the whole computation's
    cross-entropy refuses them too), not as an error inside meshfit's chunks."""
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([[1, 2, -100], [4, 9, 0]])
    assert torch.isfinite(linear_cross_entropy(hidden, weight, None, ids))
    for targets, words in (
        (ids.float(), "must be token ids (integers), not torch.float32"),
        (ids[:, :2], "targets hold 4 tokens but the LM head was given 6"),
        (
            torch.tensor([[1, 2, -100], [4, 10, 0]]),
            "a target token id is 10, outside the vocabulary's 0..9",
        ),
        (torch.tensor([[1, 2, -100], [-3, 1, 0]]), "a target token id is -3"),
    ):
        with pytest.raises(mf.MeshfitError, match=words.replace("(", r"\(").replace(")", r"\)")):
            linear_cross_entropy(hidden, weight, None, targets, chunk_tokens=2)


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "llama"},  # mf.losses.cross_entropy(shift=True), an untied head
        {"model": "llama", "loss": "model", "evaluate": True},  # its own loss; evaluate too
        {"model": "gpt2"},  # a head tied to the token embedding
        {"model": "gpt2", "loss": "model"},
        {"model": "eurobert", "loss": "model"},  # a masked LM's own loss, a head with a bias
        {"model": "bert"},  # BERT's prediction head (a bias), mf.losses.cross_entropy
        {"model": "gpt"},  # meshfit's GPT: a Linear named lm_head
    ],
    ids=lambda s: f"{s['model']}-{s.get('loss', 'pair')}",
)
def test_one_process_trains_as_with_the_whole_logits(spec: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(spec, head_run(spec), head_run({**spec, "chunks": False}))


def test_what_it_cannot_do_is_refused_in_one_line() -> None:
    """A model's own loss that is not transformers' token loss (BERT's mean), a model
    that soft-caps its logits before its loss (Gemma 2: refused at the first step, the
    stand-in never trained on), a loss of the user's own and metrics (they read the
    logits), a model with no LM head."""
    specs = [
        {"model": "bert", "loss": "model"},
        {"model": "gemma2", "loss": "model"},
        {"model": "llama", "loss": "plain"},
        {"model": "llama", "metrics": True},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own, capped, plain, metrics = many_head_runs(specs)
    assert "loss_fn='model' on this model (not Hugging Face's token loss)" in own["refused"]
    assert "was changed before the loss" in capped["refused"] and "Gemma 2" in capped["refused"]
    assert "mf.losses.cross_entropy" in plain["refused"] and "<lambda>" in plain["refused"]
    assert "metrics= read them" in metrics["refused"]
    for result in (own, capped, plain, metrics):
        assert "chunked_loss=False" in result["refused"] and "\n" not in result["refused"]
    with pytest.raises(mf.MeshfitError, match="no get_output_embeddings"):
        mf.parallelize(
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            loss_fn=mf.losses.cross_entropy(),
            chunked_loss=True,
        )
    with pytest.raises(mf.MeshfitError, match="number of tokens per chunk"):
        mf.parallelize(torch.nn.Linear(4, 4), loss_fn=mf.losses.cross_entropy(), chunked_loss=-2)


def each_as_one_process_with_the_whole_logits(specs: list[dict], nproc: int) -> None:
    """Run every spec in one launch of `nproc` workers; each equals one process with the
    whole logits (one reference per model, loss and evaluation)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = mf.launch(many_head_runs, nproc=nproc, args=(specs,))
    references: dict[str, dict] = {}
    for spec, got in zip(specs, results, strict=True):
        key = f"{spec['model']}-{spec.get('loss')}-{spec.get('evaluate')}"
        if key not in references:
            references[key] = head_run({**spec, "plan": None, "chunks": False})
        assert_same(spec, got, references[key])


@pytest.mark.slow
def test_every_plan_trains_the_one_process_run_with_the_whole_logits() -> None:
    """On 2 workers: dp, fsdp, tp (the untied Llama head split over the vocabulary: each
    rank's chunks over its half of the words, nothing gathered but two numbers a token;
    GPT-2's tied head whole on each rank), pp (the chunks on the last stage, inside
    torch's schedule), cp (targets shifted before the cut), ep (Qwen3-MoE: its experts
    split, its load-balancing loss beside the chunks), for an untied head with the
    model's own loss and a tied one with mf.losses.cross_entropy; a masked LM (a bias)
    under fsdp and tp. Each against one process with the whole logits."""
    plans = ("dp=2", "fsdp=2", "tp=2", "pp=2")
    specs = [
        *({"model": "llama", "loss": "model", "plan": p} for p in plans),
        *({"model": "gpt2", "plan": p} for p in plans),
        {"model": "llama", "loss": "model", "plan": "cp=2"},
        {"model": "eurobert", "loss": "model", "plan": "fsdp=2"},
        {"model": "eurobert", "loss": "model", "plan": "tp=2", "evaluate": True},
        {"model": "llama", "plan": "tp=2", "evaluate": True},
        {"model": "qwen3_moe", "loss": "model", "plan": "ep=2"},
    ]
    each_as_one_process_with_the_whole_logits(specs, nproc=2)


@pytest.mark.slow
def test_two_dimensional_plans_train_the_one_process_run_with_the_whole_logits() -> None:
    """On 4 workers: the chunks on the last stage with its parameters sharded (pp x
    fsdp), on the last stage with the head split over the vocabulary (pp x tp), and the
    vocabulary-parallel chunks beside data parallel (dp x tp), for the untied head with
    the model's own loss and the tied one with mf.losses.cross_entropy; and Qwen3-MoE's
    experts split beside FSDP2 (fsdp x ep)."""
    plans = ("pp=2,fsdp=2", "tp=2,pp=2", "dp=2,tp=2")
    specs = [
        *({"model": "llama", "loss": "model", "plan": p} for p in plans),
        *({"model": "gpt2", "plan": p} for p in plans),
        {"model": "qwen3_moe", "loss": "model", "plan": "fsdp=2,ep=2"},
    ]
    each_as_one_process_with_the_whole_logits(specs, nproc=4)


@pytest.mark.slow
def test_compiled_it_trains_the_eager_whole_run() -> None:
    """compile=True traces the chunks into the step's graph (the stand-in never leaves
    it), against the eager run with the whole logits; float32 (compiling float64 took
    3x as long), so float32's tolerance."""
    spec = {"model": "llama", "loss": "model", "compile": True, "float32": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = head_run(spec)
        ref = head_run({**spec, "compile": False, "chunks": False})
    assert got["chunked_calls"] > 0 and ref["chunked_calls"] == 0
    losses = max(abs(a - b) / b for a, b in zip(got["losses"], ref["losses"], strict=True))
    weights = max(weight_differences(got["state"], ref["state"]).values())
    assert losses <= 1e-5 and weights <= 1e-5, (losses, weights)
