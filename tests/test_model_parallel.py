"""Pipeline and tensor parallel reproduce the single-process run, and refuse what they
cannot split."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_same_run, check_against_one_process, make_spec
from workers import (
    GPT4,
    TINY_GPT,
    build,
    dropout_tp_runs,
    engine_run,
    many_balance_runs,
    many_engine_runs,
    skewed_sequential,
)

import meshfit as mf
from meshfit.models import GPT, GPTConfig
from meshfit.parallel.blocks import find_blocks
from meshfit.parallel.pipeline import balanced_starts, count_costs, stage_costs_of
from meshfit.parallel.tensor import check_tp_plan, derive_tp_plan

CLIPPED = {"optimizer": "adamw", "grad_clip": 0.05}


def test_two_way_model_parallel_matches_one_process() -> None:
    specs = [
        make_spec("mlp", "tp=2"),
        make_spec("gpt", "tp=2"),
        make_spec("gpt", "tp=2", **CLIPPED),
        make_spec("mlp", "pp=2"),
        make_spec("gpt", "pp=2"),
        make_spec("gpt", "pp=2", **CLIPPED),
        make_spec("mlp", "pp=2,schedule=gpipe"),
        make_spec("gpt", "pp=2,schedule=gpipe,microbatches=8"),
        make_spec("gpt4", "pp=2,schedule=interleaved-1f1b"),
        make_spec("gpt4", "pp=2,schedule=zero-bubble"),
        make_spec("deep_mlp", "pp=2,schedule=interleaved-1f1b"),
        make_spec("gpt", "pp=2", options={"pp_split": [1]}),
        # a head count under a name of its own (diffusers' `heads`), set to the local one
        make_spec("named_heads", "tp=2"),
    ]
    results = mf.launch(many_engine_runs, nproc=2, args=(specs,))
    check_against_one_process(specs, results)
    # Rank 0 runs the first stage: of the final norm and LM head that the last stage
    # trains it keeps one-element placeholders (8 bytes each in float64), not 4,224 bytes
    # of copies.
    assert specs[4] == make_spec("gpt", "pp=2") and results[4]["buffer_bytes"] == 16
    # tp splits the GPT's LM head over its 32 outputs (its logits gathered), and nothing
    # else outside the blocks; a Sequential has no head
    assert specs[1] == make_spec("gpt", "tp=2")
    assert [r["split_outside"] for r in results[1:3]] == [{"lm_head.weight": (16, 16)}] * 2
    assert results[0]["split_outside"] == {}
    # an evaluation under every schedule lets each micro-batch's output go once sent on
    # (torch kept all of them for a backward that never comes: the last stage held every
    # micro-batch's logits at once)
    kept = {s["plan"]: r["kept_after_evaluate"] for s, r in zip(specs, results, strict=True)}
    assert all(n == [0, 0] for plan, n in kept.items() if "pp=" in plan), str(kept)


@pytest.mark.slow
def test_four_way_model_parallel_matches_one_process() -> None:
    specs = [
        make_spec("gpt4", "pp=4"),
        make_spec("deep_mlp", "pp=4"),
        make_spec("gpt4", "pp=4,schedule=gpipe"),
        make_spec("deep_mlp", "pp=4,schedule=gpipe"),
        make_spec("gpt4", "tp=4"),
        make_spec("gpt4", "tp=4", **CLIPPED),
        make_spec("deep_mlp", "tp=4"),
    ]
    check_against_one_process(specs, mf.launch(many_engine_runs, nproc=4, args=(specs,)))


def test_a_cut_on_cpu_counts_attention_as_the_planner_does() -> None:
    """torch's FlopCounterMode has no formula for the CPU's fused attention kernel:
    the cut's cost of a GPT block was its projections alone (the planner's profile added
    attention by hand). parallel/flop_counts.py gives it one: the two counts agree."""
    from meshfit.planner import profile_model

    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))
    tokens = torch.zeros(2, 32, dtype=torch.long)
    costs = count_costs(model, find_blocks(model), tokens)
    block = profile_model(model, tokens).blocks[0]
    assert block.attention_flops == 4 * 4 * 32 * 32 * 8  # heads x queries x keys x depth
    assert costs.blocks[0] == 2 * block.flops  # two samples, attention included


def test_pipeline_cuts_balance_forward_flops() -> None:
    """One heavy block then five light ones: cutting by count (3+3) puts the heavy
    block and two more on stage 0; cutting by forward FLOPs must even the stages out,
    and the FLOPs, unlike a timing, are the same at every count."""
    model = skewed_sequential()
    stack = find_blocks(model)
    costs = count_costs(model, stack, torch.randn(64, 64))
    assert costs.unit == "flops" and costs.blocks[0] == 16 * costs.blocks[2]  # 64x1024x64
    assert costs.blocks[2] == 2 * 2 * 64 * 64 * 64  # two 64x64 products of 64 rows
    assert count_costs(model, stack, torch.randn(64, 64)) == costs  # no noise to move it
    starts = balanced_starts(costs, 2)
    by_count = stage_costs_of(costs, [0, 3])
    balanced = stage_costs_of(costs, starts)
    # The cut is the best of every cut on the counted costs, and better than by count
    # (which adds two light blocks to the heavy one).
    every_cut = [max(stage_costs_of(costs, [0, k])) for k in range(1, len(costs.blocks))]
    assert max(balanced) == min(every_cut), (balanced, every_cut)
    assert max(balanced) < max(by_count), (balanced, by_count)
    # Through parallelize on 2 workers: rank 0's count sets the cut, and the run
    # still trains like one process (losses equal whatever the cut).
    # Without example_inputs the engine builds on its first batch's micro-batch, and
    # counts FLOPs on it; by parameter count only when it is read before any batch.
    got, first, by_params = mf.launch(
        many_balance_runs, nproc=2, args=(["given", "first batch", "none"],)
    )
    assert got["costs"].unit == "flops" and got["starts"] == [0, 1], got["describe"]
    assert got["describe"].startswith("pipeline cut by forward FLOPs: stage 0: blocks 0-0 (")
    assert first["costs"].unit == "flops" and first["starts"] == [0, 1], first["describe"]
    assert by_params["costs"].unit == "params" and by_params["starts"] == [0, 1]
    assert got["losses"] == pytest.approx(by_params["losses"], rel=1e-5)
    assert first["losses"] == pytest.approx(got["losses"], rel=1e-5)


def test_pipeline_stages_send_activations_that_are_not_contiguous() -> None:
    """Blocks whose outputs are column-major (ConvNeXt's channels-last norm, Whisper's
    transposed input): pp=2 trains the one-process run. Control: stages sending them as
    they are fail in torch's send, and that failure is reported as meshfit's (its
    traceback and a note), not as a batch the model cannot take."""
    specs = [make_spec("column_major", "pp=2"), make_spec("column_major", "dp=1,pp=2")]
    check_against_one_process(specs[:1], mf.launch(many_engine_runs, nproc=2, args=(specs[:1],)))
    with pytest.raises(RuntimeError, match="contiguous") as caught:
        mf.launch(engine_run, nproc=2, args=({**specs[1], "unsendable": True},))
    assert not isinstance(caught.value, mf.MeshfitError)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "comes from meshfit's own code (meshfit/parallel/pipeline/schedule.py:" in notes
    assert "batch" not in str(caught.value)


def test_a_second_stack_of_another_kind_splits_what_its_code_can_follow() -> None:
    """tp splits every stack of blocks, the second of another kind too (Whisper's decoder
    beside its encoder), and tries the first block of each kind on meta: nanoGPT's
    attention in the second stack is kept whole there while its MLP splits; the first
    stack splits whole. Trains the one-process run."""
    specs = [make_spec("two_stacks", "tp=2")]
    results = mf.launch(many_engine_runs, nproc=2, args=(specs,))
    check_against_one_process(specs, results)
    split = results[0]["tp_split"]
    assert "of TitanBlock parameters" in split and "of Block parameters" in split, split
    assert "attn kept whole: its split forward fails" in split, split


def test_dropout_under_tp_draws_the_same_masks_on_every_tp_rank() -> None:
    """The tp ranks compute the same replicated activations, so their dropout must draw
    the same masks: fit seeded each rank apart, and a script seeding by rank did too,
    and the ranks' copies of every replicated weight drifted apart (pos_emb 19% after 3
    steps: a different run). Control: each rank its own masks."""
    specs = [
        {"plan": "tp=2", "via": "fit"},
        {"plan": "tp=2", "via": "engine"},
        {"plan": "tp=2", "via": "fit", "unshared": True},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_gap, engine_gap, control = mf.launch(dropout_tp_runs, nproc=2, args=(specs,))
    assert fit_gap == (0.0, None) and engine_gap == (0.0, None)
    assert control[0] > 1e-3, control


def test_balanced_starts_is_optimal_on_known_costs() -> None:
    from meshfit.parallel.pipeline import StageCosts

    costs = StageCosts(unit="flops", blocks=[8, 1, 1, 1, 1, 1, 1, 1, 1], head=0, tail=0)
    assert balanced_starts(costs, 2) == [0, 1]
    assert balanced_starts(costs, 3) == [0, 1, 5]
    uniform = StageCosts(unit="flops", blocks=[1] * 8, head=2, tail=2)
    assert stage_costs_of(uniform, balanced_starts(uniform, 4)) == [3, 3, 3, 3]


def test_tp_plan_is_derived_for_the_gpt_and_a_sequential() -> None:
    plan = derive_tp_plan(GPT(GPT4))
    assert plan["blocks.0.attn.q_proj"] == "colwise"
    assert plan["blocks.3.attn.out_proj"] == "rowwise"
    assert plan["blocks.1.mlp.up"] == "colwise" and plan["blocks.1.mlp.down"] == "rowwise"
    assert "lm_head" not in plan and len(plan) == 6 * GPT4.n_layer
    seq = derive_tp_plan(build("mlp")[0])
    assert seq == {"0": "colwise", "2": "rowwise"}


def test_tp_refuses_heads_or_sizes_it_does_not_divide() -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=3, n_embd=24, vocab_size=32, block_size=8))
    with pytest.raises(
        mf.MeshfitError, match=r"does not divide the 3 attention heads of blocks\.0\.attn"
    ):
        check_tp_plan(model, derive_tp_plan(model), 2)
    with pytest.raises(
        mf.MeshfitError, match=r"tp=5 does not divide blocks\.0\.attn\.q_proj's output size 24"
    ):
        check_tp_plan(model, derive_tp_plan(model), 5)


def test_model_without_repeated_blocks_is_refused_with_the_way_out() -> None:
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Linear(4, 8)
            self.decoder = torch.nn.Conv1d(8, 4, 1)

    with pytest.raises(
        mf.MeshfitError, match="cannot find repeated blocks.*blocks='model.layers'.*tp_plan"
    ):
        find_blocks(TwoHeads())


def test_tp_refuses_attention_that_reshapes_with_a_head_count_it_cannot_localise() -> None:
    # GlobalHeads views q/k/v with a count kept on its class: on a rank holding half the
    # width it would make heads half as wide and train wrongly; the split model's check
    # on the traced input refuses it on every rank, before any update.
    spec = make_spec("global_heads", "tp=2")
    with pytest.raises(
        mf.MeshfitError,
        match=r"tensor parallel split GlobalHeads as derived \(q: colwise, k: colwise, "
        r"v: colwise, o: rowwise\) and its output moved by .*; pass a tp_plan",
    ):
        mf.launch(many_engine_runs, nproc=2, args=([spec],))


def test_pipeline_refuses_more_stages_than_blocks() -> None:
    spec = make_spec("gpt", "pp=2,schedule=interleaved-1f1b")  # 4 stages, 2 blocks
    # the fix it names is one that can run: 2 blocks make no 2 interleaved stages per rank
    with pytest.raises(
        mf.MeshfitError,
        match=r"needs 4 stages but GPT has only 2 blocks in 'blocks'; use "
        r"schedule='1f1b'$",
    ):
        mf.launch(many_engine_runs, nproc=2, args=([spec],))


@pytest.mark.slow
def test_tp_and_pp_checkpoints_load_in_one_process(tmp_path) -> None:
    from workers import optimizer_factory, save_runs

    specs = [make_spec("gpt", "tp=2", steps=3), make_spec("gpt", "pp=2", steps=3)]
    paths = [str(tmp_path / "tp"), str(tmp_path / "pp")]
    saved = mf.launch(save_runs, nproc=2, args=(specs, paths))
    for spec, path, got in zip(specs, paths, saved, strict=True):
        model, loss_fn = build("gpt")
        engine = mf.parallelize(model, "dp=1", optimizer=optimizer_factory("sgd"), loss_fn=loss_fn)
        meta = engine.load(path)
        assert meta["plan"] == f"dp=1,{spec['plan']}" and engine.step_count == 3
        loaded = engine.user_model.state_dict()
        assert loaded.keys() == got["state"].keys()
        for name, value in got["state"].items():
            assert torch.equal(loaded[name], value), (spec["plan"], name)
        # The optimizer state came too: SGD momentum for every parameter.
        assert len(engine.optimizer.state) == len(list(model.parameters()))


def test_fit_with_a_pipeline_matches_one_process() -> None:
    from workers import fit_run

    spec = {"model": "gpt", "steps": 4, "batch": 8, "samples": 32, "optimizer": "sgd"}
    ref = fit_run({**spec, "plan": "dp=1"})
    got = mf.launch(fit_run, nproc=2, args=({**spec, "plan": "pp=2,microbatches=2"},))
    assert_same_run(got, ref)


@pytest.mark.slow
def test_hugging_face_llama_splits_without_changes() -> None:
    """A transformers LlamaForCausalLM (grouped-query attention, rotary positions,
    blocks called with masks and position tables) under pp=2 and tp=2."""
    pytest.importorskip("transformers")
    specs = [make_spec("llama", "pp=2"), make_spec("llama", "tp=2")]
    check_against_one_process(specs, mf.launch(many_engine_runs, nproc=2, args=(specs,)))


def test_a_one_layer_model_still_has_its_layer_stack() -> None:
    from meshfit.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    model.extra = torch.nn.ModuleList([torch.nn.Dropout()])  # one block, no parameters
    stack = find_blocks(model)
    assert stack.name == "blocks" and stack.keys == ["0"]
    assert set(derive_tp_plan(model)) >= {"blocks.0.attn.q_proj", "blocks.0.mlp.down"}


class _SkipBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, x0: torch.Tensor | None = None) -> torch.Tensor:
        return x + torch.tanh(self.lin(x if x0 is None else x + x0))


class _SkipFromEmbeddings(torch.nn.Module):
    """Every block also takes the embeddings: a weight-dependent side input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_SkipBlock() for _ in range(4))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x0 = self.emb(x)
        for block in self.blocks:
            h = block(h, x0)
        return self.head(h)


class _NormRegisteredFirst(torch.nn.Module):
    """The final norm is registered before the blocks but runs after them."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.emb = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_SkipBlock() for _ in range(4))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _stage(model: torch.nn.Module, first: bool):
    """A pipeline stage of `model` (first or last half of its blocks), in one process."""
    import contextlib

    from meshfit.parallel.blocks import find_blocks
    from meshfit.parallel.pipeline import StageModule, _head_tail_parameters, _modules_outside

    stack = find_blocks(model)
    head, tail = _head_tail_parameters(model, stack)
    half = len(stack.keys) // 2
    keys = stack.keys[:half] if first else stack.keys[half:]
    return StageModule(
        model,
        stack,
        keys,
        is_first=first,
        is_last=not first,
        params=list(model.parameters()),
        autocast=contextlib.nullcontext,
        outside=_modules_outside(model, stack, head, tail),
        next_key=stack.keys[half] if first else None,
    )


def test_pipeline_refuses_a_model_its_cut_would_train_wrongly() -> None:
    """Both models ran under pp=2 with different numbers than one process before these
    checks (a skip from the embeddings: weights off by 2e-2); now the first forward of
    a stage refuses them, before any update, in training and in evaluation alike."""
    x = torch.randn(4, 8)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            with pytest.raises(mf.MeshfitError, match="'blocks.0' takes positional argument 2"):
                _stage(_SkipFromEmbeddings(), first=True)(x)
            hidden = torch.randn(4, 16)
            with pytest.raises(mf.MeshfitError, match="'norm' is registered before the blocks"):
                _stage(_NormRegisteredFirst(), first=False)(hidden, model_inputs=x)
    model = GPT(TINY_GPT)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size))
    first, last = _stage(model, first=True), _stage(model, first=False)
    for _ in range(2):  # the checked first call and an unchecked one agree
        hidden = first(tokens)
        assert torch.equal(last(hidden, model_inputs=tokens), model(tokens))


class _NormEverywhere(_NormRegisteredFirst):
    """The norm runs where `where` says: between the blocks, or before and after them."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.where == "both":
            h = self.norm(h)
        for i, block in enumerate(self.blocks):
            h = block(self.norm(h) if self.where == "between" and i == 2 else h)
        return self.head(self.norm(h))


def test_the_check_forward_places_outside_modules_where_they_run() -> None:
    """The cut's check forward (on example_inputs) reads where each module outside the
    blocks runs: a norm registered before the blocks and run after them goes to the last
    stage (OPT's final_layer_norm; the zoo trains OPT under pp); one run between the
    blocks, or on both sides, cannot live on one stage and is refused."""
    from meshfit.parallel.blocks import find_blocks
    from meshfit.parallel.pipeline.cut import _checked, _head_tail_parameters

    def check(model: torch.nn.Module) -> dict[str, str]:
        stack = find_blocks(model)
        with _checked(model, stack, *_head_tail_parameters(model, stack)) as found:
            model(torch.randn(4, 8))
        return found.moved

    assert check(_NormRegisteredFirst()) == {"norm": "after"}
    for where, words in (
        ("between", "runs between the blocks"),
        ("both", "runs before and after them"),
    ):
        with pytest.raises(mf.MeshfitError, match=f"'norm' {words}"):
            check(_NormEverywhere(where))


def test_tp_plan_patterns_are_checked_like_names() -> None:
    """A pattern key, as meshfit's own error message recommends, gets the same size and
    head checks as a plain name."""
    model = GPT(GPTConfig(n_layer=2, n_head=3, n_embd=24, vocab_size=32, block_size=8))
    with pytest.raises(
        mf.MeshfitError, match=r"does not divide the 3 attention heads of blocks\.0"
    ):
        check_tp_plan(model, {"blocks.*.attn.q_proj": "colwise"}, 2)
    with pytest.raises(mf.MeshfitError, match=r"tp=5 does not divide blocks\.0\.mlp\.up"):
        check_tp_plan(model, {"blocks.*.mlp.up": "colwise"}, 5)
    check_tp_plan(model, {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}, 2)


@pytest.mark.slow
def test_fsdp_x_pp_refuses_a_parameter_on_the_model_itself() -> None:
    # FSDP2 over the model would take every block's parameters too (torch raised
    # "Cannot concatenate overlapping meshes"); refused in one line instead.
    spec = make_spec("root_param", "fsdp=2,pp=2")
    with pytest.raises(mf.MeshfitError, match=r"fsdp x pp cannot shard scale.*'dp=2,pp=2'"):
        mf.launch(many_engine_runs, nproc=4, args=([spec],))


def test_pipeline_with_a_parameter_on_the_model_itself_matches_one_process() -> None:
    # RootScaled's loop applies tanh after each block, outside it: stages used to leave
    # after their last block and send its output without the tanh (a strict xfail
    # recorded the loss 1.61975 vs 1.61907 from step 0); a stage now sends what the next
    # block would be called with.
    specs = [make_spec("root_param", "pp=2")]
    check_against_one_process(specs, mf.launch(many_engine_runs, nproc=2, args=(specs,)))


def test_tp_plan_and_pp_split_without_their_form_are_refused_not_ignored() -> None:
    model, loss_fn = build("mlp")
    with pytest.raises(mf.MeshfitError, match=r"tp_plan is for tp > 1.*add tp=N"):
        mf.parallelize(model, None, loss_fn=loss_fn, tp_plan={"0": "colwise"})
    with pytest.raises(mf.MeshfitError, match=r"pp_split is for pp > 1.*drop pp_split"):
        mf.parallelize(model, None, loss_fn=loss_fn, pp_split=[2])


def _derived(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, float]]:
    from meshfit.parallel.tensor import tp_share

    plan = derive_tp_plan(model)
    return plan, tp_share(model, plan)


def test_tp_plan_is_derived_from_the_computation_for_transformer_families() -> None:
    """No names: what reads the block input is column-parallel, what writes back to it
    row-parallel, for GPT-2 (Conv1D, q|k|v fused in one), Llama (grouped-query
    attention, a gated MLP), BERT (an encoder whose layers are all called `dense` or
    query/key/value), T5 (encoder-decoder) and GPT-NeoX (fused per head); each splits >= 95% of its blocks'
    parameters, even in these tiny configs (biases and norms weigh more here)."""
    pytest.importorskip("transformers")
    from workers import build_lm

    from meshfit.parallel.tensor.derive import _derive

    gpt2 = build_lm("gpt2")
    plan, share = _derived(gpt2)
    h = "transformer.h.1"
    assert (
        plan
        == {
            **plan,
            f"{h}.attn.c_attn": "colwise:3",  # split first into q, k, v: per chunk
            f"{h}.attn.c_proj": "rowwise",
            f"{h}.mlp.c_fc": "colwise",
            f"{h}.mlp.c_proj": "rowwise",
        }
        and len(plan) == 8
    )
    # the forward splits c_attn's output with split_size: each rank needs its own width
    assert _derive(gpt2).local_attrs[f"{h}.attn"] == {"split_size": 16}
    assert share["GPT2Block"] >= 0.95

    llama = build_lm("llama")
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads
    plan, share = _derived(llama)
    layer = "model.layers.0"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):  # fmt: skip
        assert plan[f"{layer}.{name}"] == "colwise", name
    assert plan[f"{layer}.self_attn.o_proj"] == plan[f"{layer}.mlp.down_proj"] == "rowwise"
    assert "lm_head" not in plan and share["LlamaDecoderLayer"] >= 0.95

    plan, share = _derived(build_lm("bert"))
    layer = "bert.encoder.layer.1"
    assert {k.removeprefix(layer + "."): v for k, v in plan.items() if k.startswith(layer)} == {
        "attention.self.query": "colwise",
        "attention.self.key": "colwise",
        "attention.self.value": "colwise",
        "attention.output.dense": "rowwise",
        "intermediate.dense": "colwise",
        "output.dense": "rowwise",
    }
    assert share["BertLayer"] >= 0.95

    # T5: the decoder's stack too, its cross-attention's k/v (reading the encoder output),
    # and the per-head position table of each stack's first block, split with the heads
    plan, share = _derived(build_lm("t5"))
    for stack in ("encoder", "decoder"):
        table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
        assert plan[table] == "colwise" and plan[f"{stack}.block.1.layer.0.SelfAttention.o"]
    assert plan["decoder.block.1.layer.1.EncDecAttention.k"] == "colwise"
    assert plan["decoder.block.1.layer.1.EncDecAttention.o"] == "rowwise"
    assert share["T5Block"] >= 0.95

    # OLMo2 normalises q and k over all heads at once: a rank holding half of q would
    # normalise by half; its attention stays whole, its MLP splits
    plan, share = _derived(build_lm("olmo2"))
    assert not any("self_attn" in name for name in plan)
    assert plan["model.layers.1.mlp.up_proj"] == "colwise"
    assert plan["model.layers.1.mlp.down_proj"] == "rowwise"
    assert 0.5 < share["Olmo2DecoderLayer"] < 0.95

    # NeoX views the fused output per head before cutting q, k, v: a plain column split
    # already gives each rank whole heads
    plan, share = _derived(build_lm("neox"))
    assert plan["gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    assert plan["gpt_neox.layers.0.attention.dense"] == "rowwise"
    assert share["GPTNeoXLayer"] >= 0.95


class _BiasedExperts(torch.nn.Module):
    """Experts with a bias after the down projection (as GPT-OSS's): split, each rank
    would add it once to its partial sum."""

    def __init__(self, experts: int = 2, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(experts, hidden, width) / 4)
        self.down = torch.nn.Parameter(torch.randn(experts, width, hidden) / 4)
        self.down_bias = torch.nn.Parameter(torch.zeros(experts, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.up.shape[0]):
            out = out + torch.tanh(x @ self.up[e].t()) @ self.down[e].t() + self.down_bias[e]
        return out


class _ExpertsBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.experts = _BiasedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.norm(x))


class _ExpertsModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(_ExpertsBlock() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def test_tp_splits_every_experts_mlp_of_a_mixture_of_experts() -> None:
    """Mixtral keeps its experts as 3-D parameters (gate_up_proj [experts, 2 x
    intermediate, hidden], down_proj [experts, hidden, intermediate]) that no Linear
    holds: followed through the slices and transposes its forward takes of them to the
    products that multiply them (F.linear per expert, or one grouped_mm), gate|up is
    split per chunk and down row-wise; the router, whose softmax spans all experts,
    stays whole. Experts read in a way the trace does not follow (batched_mm's bmm with
    the weight first), or holding a bias the split would add once per rank, stay whole,
    and the share line says why."""
    pytest.importorskip("transformers")
    from zoo import hf_mixtral

    from meshfit.parallel.tensor import tp_share
    from meshfit.parallel.tensor.derive import _derive

    layer = "model.layers.1.mlp"
    for implementation in ("grouped_mm", "eager"):
        model = hf_mixtral()
        model.config._experts_implementation = implementation
        split = _derive(model)
        assert split.plan[f"{layer}.experts.gate_up_proj"] == "colwise:2", implementation
        assert split.plan[f"{layer}.experts.down_proj"] == "rowwise", implementation
        assert f"{layer}.gate.weight" not in split.plan and not split.whole
        assert tp_share(model, split.plan)["MixtralDecoderLayer"] >= 0.95

    model = hf_mixtral()
    model.config._experts_implementation = "batched_mm"
    split = _derive(model)
    assert not any("experts" in name for name in split.plan)
    assert split.whole == {"mlp.experts": "gate_up_proj: read by bmm, which tp does not split"}

    # nothing else to split in these blocks: refused, saying why the experts stay whole
    with pytest.raises(
        mf.MeshfitError,
        match=r"finds nothing to split in _ExpertsModel: .*; experts kept whole: experts also "
        r"holds down_bias, which would stay whole; use dp, fsdp or pp",
    ):
        _derive(_ExpertsModel(), torch.zeros(2, 3, dtype=torch.long))


def test_tp_refuses_a_cnn_whose_blocks_hold_no_pair_with_the_plans_that_fit() -> None:
    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.norm(self.conv(x)))

    class CNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = torch.nn.ModuleList(Stage() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage in self.stages:
                x = stage(x)
            return x.mean((2, 3))

    # one convolution per block, its output added to the block's input: no pair
    with pytest.raises(
        mf.MeshfitError,
        match=r"tensor parallel finds nothing to split in CNN: no matrix product in its "
        r"blocks \('stages'\) reads the block's input and feeds, .* one that writes back",
    ):
        derive_tp_plan(CNN(), torch.zeros(2, 4, 6, 6))

    class Depthwise(torch.nn.Module):  # grouped convolutions mix no channels: no product
        def __init__(self) -> None:
            super().__init__()
            self.stages = torch.nn.ModuleList(
                torch.nn.Conv2d(4, 4, 3, padding=1, groups=4) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage in self.stages:
                x = x + stage(x)
            return x.mean((2, 3))

    with pytest.raises(
        mf.MeshfitError,
        match=r"tensor parallel finds nothing to split in Depthwise: its blocks hold no "
        r"matrix-product layer \(Linear, convolution\), only Conv2d; use dp, fsdp or pp",
    ):
        derive_tp_plan(Depthwise())

    class Unpaired(torch.nn.Module):  # a Linear per block, its output the block output
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for block in self.blocks:
                h = h + torch.tanh(block(h))
            return h

    with pytest.raises(mf.MeshfitError, match="finds nothing to split in Unpaired: no matrix"):
        derive_tp_plan(Unpaired())


def test_tp_refuses_heads_it_does_not_divide_in_a_derived_fused_plan() -> None:
    """GPT-2's head count sits on its attention module, whatever the projections' names;
    each of the fused q, k, v is checked on its own width."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=24, n_layer=1, n_head=3)
    model = GPT2LMHeadModel(config)
    plan = derive_tp_plan(model)
    assert plan["transformer.h.0.attn.c_attn"] == "colwise:3"
    with pytest.raises(
        mf.MeshfitError, match=r"does not divide the 3 attention heads of transformer\.h\.0\.attn"
    ):
        check_tp_plan(model, plan, 2)
    with pytest.raises(
        mf.MeshfitError,
        match=r"tp=5 does not divide transformer\.h\.0\.attn\.c_attn's output size 24 in each "
        r"of its 3 fused parts",
    ):
        check_tp_plan(model, plan, 5)
