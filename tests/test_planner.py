"""The planner: its formulas, its profile of a model and its search (one process, fast).

Memory measured against the prediction on CPU workers is in test_planner_memory.py."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshfit as mf
from meshfit.errors import MeshfitError
from meshfit.models.gpt import GPT, GPTConfig
from meshfit.plan import Plan
from meshfit.planner import Hardware, estimate, hardware, plan_search, profile_model
from meshfit.planner.auto import (
    choose_plan,
    fixed_fields,
    optimizer_for_planning,
    optimizer_state_bytes,
)
from meshfit.planner.memory import _block_flops, in_flight
from meshfit.planner.profile import ModelProfile, PartCost
from meshfit.planner.search import search_profile
from meshfit.state.checkpoint import META_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=32)


def gpt(device: str = "cpu") -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(CONFIG)


def tokens(n: int = 2) -> torch.Tensor:
    return torch.zeros(n, CONFIG.block_size, dtype=torch.long)


def hand_profile(blocks: int = 8, params: int = 1000, flops: float = 1e6) -> ModelProfile:
    """A model described by hand: `blocks` equal blocks, no head or tail."""
    part = PartCost(params=params, flops=flops, saved=4000, input_bytes=400, tp_share=1.0)
    return ModelProfile(
        name="Hand",
        blocks=[dataclasses.replace(part, tp_reductions=2) for _ in range(blocks)],
        head=PartCost(),
        tail=PartCost(),
        total_params=blocks * params,
        tied_params=0,
        output_bytes=0.0,
        tokens_per_sample=1,
        param_bytes=4,
    )


# ---- the formulas ------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero3_model_state_is_16_bytes_per_parameter_over_n(n):
    """ZeRO-3 with Adam: 4 (parameter) + 4 (gradient) + 8 (two moments) bytes per
    parameter, divided over the n shards (Rajbhandari et al. 2020)."""
    profile = hand_profile()
    e = estimate(profile, Plan(dp=1, fsdp=n), batch_size=n)
    states = e.memory.parameters + e.memory.gradients + e.memory.optimizer
    assert states == pytest.approx(16 * profile.total_params / n)


def test_an_estimate_without_dp_or_a_world_size_means_dp_1_and_says_so():
    """`estimate(model, "fsdp=64", ...)` stopped with "give the plan's dp, or hardware";
    the plan names every degree the user cares about."""
    e = estimate(gpt("meta"), "fsdp=4", batch_size=8, example_inputs=tokens())
    assert e.plan == Plan(dp=1, fsdp=4)
    assert e.notes[0].startswith("dp not given: estimated with dp=1, 4 devices")
    assert "(dp not given" in e.summary()
    assert (
        estimate(gpt("meta"), "fsdp=4", batch_size=8, example_inputs=tokens(), world_size=8).plan.dp
        == 2
    )


def test_ddp_keeps_a_second_gradient_copy_in_its_buckets():
    profile = hand_profile()
    e = estimate(profile, Plan(dp=2), batch_size=2, optimizer="sgd")
    assert e.memory.gradients == pytest.approx(4 * profile.total_params)
    assert e.memory.buffers == pytest.approx(4 * profile.total_params)
    assert e.memory.optimizer == 0


def test_fsdp_under_pp_counts_the_stage_held_gathered_until_the_step_ends():
    """With several micro-batches torch's schedule keeps an FSDP stage gathered, with
    its unsharded gradients, until one reduce-scatter at the step's end: a whole stage
    of parameters and gradients more than one micro-batch (each block reduced and freed
    after its own backward) needs. Counting one block for both undercounted pp=2,fsdp=2
    on a 582 MiB Llama by ~300 MiB per rank (tests/test_capped.py)."""
    profile = hand_profile(blocks=8, params=1000)
    # no activations crossing stages: the receive buffers scale with the micro-batch
    profile.blocks = [dataclasses.replace(b, input_bytes=0) for b in profile.blocks]
    held = estimate(
        profile, Plan(dp=1, fsdp=2, pp=2, schedule="gpipe", microbatches=4), batch_size=4
    )
    lean = estimate(
        profile, Plan(dp=1, fsdp=2, pp=2, schedule="gpipe", microbatches=1), batch_size=4
    )
    stage, block = 4 * 1000, 1000  # parameters of one stage's 4 blocks, of one block
    # held: the stage gathered (4 bytes) and its gradients (4); lean: one block gathered
    # twice (this one's and the next one's, prefetched) and its gradients
    assert held.memory.buffers - lean.memory.buffers == pytest.approx(
        stage * (4 + 4) - (2 * block * 4 + block * 4)
    )


def test_tensor_parallel_divides_the_split_share_and_its_activations():
    profile = hand_profile()
    for part in profile.blocks:
        part.tp_share, part.saved_split = 0.75, 3000
    one = estimate(profile, Plan(dp=1), batch_size=1)
    two = estimate(profile, Plan(dp=1, tp=2), batch_size=1)
    assert two.memory.parameters == pytest.approx(one.memory.parameters * (0.25 + 0.75 / 2))
    assert two.memory.activations == pytest.approx(one.memory.activations * (1000 + 1500) / 4000)


def test_schedules_hold_the_micro_batches_they_should():
    """GPipe keeps every micro-batch's activations, 1F1B at most pp - stage."""
    gpipe = Plan(dp=1, pp=4, microbatches=8, schedule="gpipe")
    one_f_one_b = Plan(dp=1, pp=4, microbatches=8, schedule="1f1b")
    assert [in_flight(gpipe, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight(one_f_one_b, r) for r in range(4)] == [4, 3, 2, 1]
    profile = hand_profile()
    e_gpipe = estimate(profile, gpipe, batch_size=8)
    e_1f1b = estimate(profile, one_f_one_b, batch_size=8)
    assert e_gpipe.memory.activations == pytest.approx(2 * e_1f1b.memory.activations)


def test_full_recomputation_keeps_block_inputs_and_one_block():
    profile = hand_profile()
    none = estimate(profile, Plan(dp=1), batch_size=1)
    full = estimate(profile, Plan(dp=1, checkpointing="full"), batch_size=1)
    assert none.memory.activations == pytest.approx(8 * 4000)
    assert full.memory.activations == pytest.approx(8 * 400 + 4000)


def test_offload_moves_the_model_state_to_host_memory():
    e = estimate(hand_profile(), Plan(dp=1, fsdp=2, offload=True), batch_size=2)
    assert e.memory.parameters == e.memory.gradients == e.memory.optimizer == 0
    assert e.memory.host == pytest.approx(16 * 8000 / 2)


def test_optimizer_state_bytes_are_read_from_the_optimizer_itself():
    assert optimizer_state_bytes(lambda p: torch.optim.AdamW(p)) == 8
    assert optimizer_state_bytes(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 4
    assert optimizer_state_bytes(lambda p: torch.optim.SGD(p, lr=0.1)) == 0
    assert optimizer_state_bytes(None) == 8  # meshfit's default: AdamW


def test_optimizer_for_planning_names_the_ones_the_planner_knows():
    from meshfit.options import default_optimizer

    h100 = hardware("h100")
    assert optimizer_for_planning(None) == "adamw"  # meshfit's default (fused on a GPU)
    assert optimizer_for_planning(default_optimizer, h100) == "adamw"
    # torch's own default: one parameter at a time on the CPU, a list at a time on a GPU
    assert optimizer_for_planning(lambda p: torch.optim.Adam(p)) == "adam:for-loop"
    assert optimizer_for_planning(lambda p: torch.optim.Adam(p), h100) == "adam:foreach"
    # the factory's own choice, wherever it runs
    fused = optimizer_for_planning(lambda p: torch.optim.AdamW(p, fused=True))
    assert fused == "adamw:fused"
    looped = optimizer_for_planning(lambda p: torch.optim.AdamW(p, foreach=False), h100)
    assert looped == "adamw:for-loop"
    listed = optimizer_for_planning(lambda p: torch.optim.RMSprop(p, foreach=True))
    assert listed == "rmsprop:foreach"
    assert optimizer_for_planning(lambda p: torch.optim.SGD(p, lr=0.1)) == "sgd:for-loop"
    momentum = optimizer_for_planning(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert momentum == "sgd-momentum:for-loop"
    assert optimizer_for_planning(lambda p: torch.optim.Adamax(p)) == 8  # its state bytes
    with pytest.raises(MeshfitError, match="'adamw:foreach'"):
        estimate(hand_profile(), Plan(dp=1), batch_size=1, optimizer="adamw:vectorised")
    with pytest.raises(MeshfitError, match="torch has no fused RMSprop"):
        estimate(hand_profile(), Plan(dp=1), batch_size=1, optimizer="rmsprop:fused")


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "sgd-momentum", "adagrad", "rmsprop"])
def test_the_planner_s_optimizer_temporaries_are_what_torch_makes(name, monkeypatch):
    """The tables the planner counts a step's temporaries from (memory.py), measured
    again on torch's CPU code paths with each implementation forced
    (benchmarks/optimizer_temporaries.py): one parameter at a time (the largest
    parameter's size), a list at a time (all of them), fused (none)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from optimizer_temporaries import STEPPINGS, counted, made

    shapes = [(1024, 256), (256, 256)]
    smaller = 256 * 256 * 4
    for stepping in STEPPINGS:
        got = made(name, stepping, shapes)
        if got is None:
            assert (name, stepping) == ("rmsprop", "fused")  # torch has no fused RMSprop
            continue
        count = counted(name, stepping, shapes)
        # one parameter at a time, the smaller one's temporary may still be bound when the
        # larger's is made (Adagrad, RMSprop: 1.25 x the larger, counted as 1); a few
        # scalars beside
        assert count <= got <= count + smaller + 4096, (stepping, got, count)


def test_the_optimizer_step_is_a_peak_with_its_temporaries_on_the_cpu():
    """Few activations and a large embedding: the step's peak is where AdamW steps, one
    parameter at a time on the CPU, with two temporaries the size of the rank's largest
    parameter (a block's split by tp, the embedding whole); fused on a GPU: none."""
    profile = hand_profile(blocks=2, params=1000)
    profile.blocks = [dataclasses.replace(b, saved=4, largest_param=500) for b in profile.blocks]
    profile.head = PartCost(params=100_000, largest_param=100_000)
    profile.total_params += 100_000
    profile.largest_param = 100_000
    state = 16 * 102_000  # parameters, gradients, AdamW's moments
    cpu = estimate(profile, Plan(dp=1), batch_size=1)
    assert cpu.memory.stepping == 2 * 100_000 * 4
    assert cpu.memory.total == pytest.approx(state + 2 * 100_000 * 4)
    fsdp = estimate(profile, Plan(dp=1, fsdp=2), batch_size=2)
    assert fsdp.memory.stepping == 100_000 * 4  # each rank steps its half of it
    stages = estimate(profile, Plan(dp=1, pp=2), batch_size=1).ranks
    assert [r.stepping for r in stages] == [2 * 100_000 * 4, 2 * 500 * 4]  # the head's stage
    split = dataclasses.replace(profile, head=PartCost(params=100, largest_param=100))
    tp = estimate(split, Plan(dp=1, tp=2), batch_size=1)
    assert tp.memory.stepping == 2 * 500 / 2 * 4  # the blocks' largest, split
    assert estimate(profile, Plan(dp=1), batch_size=1, optimizer="sgd").memory.stepping == 0
    gpu = estimate(profile, Plan(dp=1), batch_size=1, hardware="h100")
    assert gpu.memory.stepping == 0 and gpu.memory.total < cpu.memory.total
    offload = estimate(profile, Plan(dp=1, fsdp=2, offload=True), batch_size=2)
    assert offload.memory.stepping == 0  # the optimizer steps on the host
    # a user's AdamW left to torch's default on a GPU steps a list at a time: one
    # temporary the size of all the rank's parameters (its fsdp shard of them)
    listed = estimate(profile, Plan(dp=1, fsdp=2), batch_size=2, hardware="h100",
                      optimizer="adamw:foreach")  # fmt: skip
    assert listed.memory.stepping == 102_000 / 2 * 4
    # and fused, or one at a time, wherever it is told
    fused = estimate(profile, Plan(dp=1), batch_size=1, optimizer="adamw:fused")
    assert fused.memory.stepping == 0
    looped = estimate(profile, Plan(dp=1), batch_size=1, hardware="h100",
                      optimizer="adamw:for-loop")  # fmt: skip
    assert looped.memory.stepping == cpu.memory.stepping
    # a bare name other than meshfit's AdamW steps as torch's default: a list at a time
    adam = estimate(profile, Plan(dp=1), batch_size=1, hardware="h100", optimizer="adam")
    assert adam.memory.stepping == 102_000 * 4
    # an expert weight holds 1/ep of the experts (outside FSDP2), the rest 1/fsdp
    moe = dataclasses.replace(split, blocks=[
        dataclasses.replace(b, largest_param=100, largest_expert=800, expert_params=800)
        for b in split.blocks])  # fmt: skip
    assert estimate(moe, Plan(dp=1, fsdp=2), batch_size=2).memory.stepping == 2 * 400 * 4
    both = estimate(moe, Plan(dp=1, fsdp=2, ep=2), batch_size=2)
    assert both.memory.stepping == 2 * 800 / 2 * 4
    # a list at a time under ep: the rank's parameters, its experts 1/ep of them (each
    # block: 1000 parameters, 800 of them experts' -> 200 / 2 + 800 / 2)
    listed = estimate(moe, Plan(dp=1, fsdp=2, ep=2), batch_size=2, optimizer="adamw:foreach")
    assert listed.memory.stepping == (2 * (100 + 400) + 100 / 2) * 4
    dense = dataclasses.replace(moe, blocks=[
        dataclasses.replace(b, largest_param=2000) for b in moe.blocks])  # fmt: skip
    assert estimate(dense, Plan(dp=1, fsdp=2, ep=2), batch_size=2).memory.stepping == 2 * 1000 * 4


def test_the_last_stage_holds_its_output_once_whatever_the_loss_saves():
    """Under pp torch's stage keeps a micro-batch's output until its backward: counted
    beside a cross-entropy (which saves its log-softmax, not the logits), and not again
    for a mean-squared error, which saves the output itself."""
    from meshfit.models import next_token_loss

    model = gpt("meta")
    vocab = CONFIG.vocab_size
    ce = profile_model(model, tokens(), loss_fn=next_token_loss, example_targets=tokens())
    targets = torch.zeros(2, CONFIG.block_size, vocab, device="meta")
    mse = profile_model(model, tokens(), loss_fn=F.mse_loss, example_targets=targets)
    assert not ce.output_saved and mse.output_saved
    plan = Plan(dp=1, pp=2, microbatches=1)
    counted = estimate(ce, plan, batch_size=2).ranks[-1].activations
    saved = dataclasses.replace(ce, output_saved=True)
    without = estimate(saved, plan, batch_size=2).ranks[-1].activations
    assert counted - without == pytest.approx(ce.output_bytes * 2)  # a micro-batch of 2


def test_pipeline_bubble_is_pp_minus_one_micro_batch_times():
    hw = Hardware("ideal", 1e12, {"fp32": 1e9}, {"fp32": 1e9}, 1e15, 1e15, 1e15, 8,
                  latency=0.0, op_overhead=0.0)  # fmt: skip
    profile = hand_profile()
    e = estimate(profile, Plan(dp=1, pp=4, microbatches=8), batch_size=8, hardware=hw)
    per_microbatch = 2 * 1e6 * 3 / 1e9  # two blocks a stage, forward + backward
    assert e.step_time.compute == pytest.approx(8 * per_microbatch, rel=1e-3)
    assert e.step_time.bubble == pytest.approx(3 * per_microbatch, rel=1e-3)


# ---- the profile -------------------------------------------------------------------


def test_profile_on_meta_matches_the_profile_on_cpu():
    """The meta device (no memory) sees the same FLOPs and the same saved bytes as the
    real model, within the attention kernel's extra log-sum-exp."""
    on_cpu = profile_model(gpt("cpu"), tokens())
    on_meta = profile_model(gpt("meta"), tokens())
    assert on_meta.total_params == on_cpu.total_params
    for a, b in zip(on_cpu.blocks, on_meta.blocks, strict=True):
        assert b.flops == pytest.approx(a.flops, rel=1e-6)
        assert b.saved == pytest.approx(a.saved, rel=0.02)
        assert b.tp_share == pytest.approx(a.tp_share)


def test_profile_is_per_sample_and_counts_what_autograd_saves():
    two, eight = profile_model(gpt("meta"), tokens(2)), profile_model(gpt("meta"), tokens(8))
    assert two.blocks[0].saved == pytest.approx(eight.blocks[0].saved, rel=1e-3)
    assert two.blocks[0].flops == pytest.approx(eight.blocks[0].flops)
    # a Linear(64 -> 64) on 32 positions: 2 * 32 * 64 * 64 FLOPs a sample
    lin = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    p = profile_model(lin, torch.zeros(3, 32, 64))
    assert p.blocks[1].flops == 2 * 32 * 64 * 64
    assert p.blocks[1].saved == 32 * 64 * 4  # its input, float32


def test_profile_of_a_large_model_on_meta_needs_no_memory():
    with torch.device("meta"):
        big = GPT(GPTConfig(n_layer=48, n_embd=4096, n_head=32, block_size=1024, vocab_size=50304))
    p = profile_model(big, torch.zeros(1, 1024, dtype=torch.long))
    assert p.total_params > 9.5e9
    assert len(p.blocks) == 48 and p.blocks[47].flops == p.blocks[0].flops
    assert p.max_tp == 32 and p.blocks[0].tp_share > 0.99


def test_profile_of_a_hugging_face_model_on_meta():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    p = profile_model(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    assert p.total_params == sum(x.numel() for x in model.parameters())
    assert p.max_tp == 2  # the key/value heads
    assert p.blocks[0].tp_share > 0.95
    assert p.tail.flops == 2 * 16 * 64 * 128  # the LM head


def test_a_model_tensor_parallel_cannot_split_is_planned_without_tp():
    # depthwise convolutions: no channels mixed, nothing to pair
    cnn = nn.Sequential(*[nn.Conv2d(3, 3, 3, padding=1, groups=3) for _ in range(4)])
    p = profile_model(cnn, torch.zeros(2, 3, 8, 8))
    assert p.tp_error and "nothing to split" in p.tp_error
    result = plan_search(p, 4, batch_size=8, hardware="cpu")
    assert result.ranked and all(e.plan.tp == 1 for e in result.ranked)
    assert any("tensor parallel finds nothing" in d.reason for d in result.dropped)


# ---- the search --------------------------------------------------------------------


def fast_net_slow_chips() -> Hardware:
    return Hardware("hand", 1e6, {"fp32": 1e9}, {"fp32": 1e9}, 1e12, 1e12, 1e12, 8,
                    latency=0.0, op_overhead=0.0)  # fmt: skip


def test_when_no_plan_fits_the_nearest_are_shown_with_what_would_fit():
    """No plan fits (65,536 tokens: an empty table and a count of drops, no way out):
    the three nearest in memory, by how much each is over, and the levers."""
    profile = hand_profile(params=20000)
    hw = dataclasses.replace(fast_net_slow_chips(), device_memory=2e5)
    result = search_profile(profile, 8, batch_size=16, hardware=hw)
    assert not result.ranked
    table = result.table()
    lines = table.splitlines()
    assert lines[0] == "no plan fits; the nearest in memory:", table
    near = [line for line in lines[1:4] if line.startswith("  ")]
    assert len(near) == 3 and all("per rank, over by" in line for line in near), table
    needs = sorted(d.need for d in result.dropped if d.need)
    assert f"{needs[0] / (0.92 * 2e5):.1f}x the devices for the nearest" in table, table
    assert "bf16 (--precision bf16)" in table and table.splitlines()[-1].startswith("dropped: ")


def test_search_never_ranks_a_plan_that_does_not_fit():
    profile = hand_profile(params=20000)
    hw = dataclasses.replace(fast_net_slow_chips(), device_memory=1.2e6)
    result = search_profile(profile, 8, batch_size=16, hardware=hw)
    assert result.ranked
    assert all(e.memory.total <= 0.92 * 1.2e6 for e in result.ranked)
    assert any(d.reason.startswith("does not fit") for d in result.dropped)
    # 20000 x 8 parameters x 16 bytes = 2.56 MB: only sharded or offloaded plans hold it
    assert all(e.plan.fsdp * e.plan.tp * e.plan.pp > 2 or e.plan.offload for e in result.ranked)


def test_a_plan_whose_build_would_not_fit_is_marked_and_meta_lifts_it():
    """A model built on the device is whole on every rank before the plan splits it: a
    plan whose steady state fits but whose build does not is no plan; built on meta, a
    rank holds its share and one parameter beside it (materialize.py)."""
    profile = hand_profile(params=20000)  # 640 KB of fp32 parameters
    profile.largest_param = 20000
    hw = dataclasses.replace(fast_net_slow_chips(), device_memory=0.65e6)
    plan = Plan(dp=1, fsdp=8)
    built = estimate(profile, plan, batch_size=8, hardware=hw)
    assert built.memory.total <= 0.92 * 0.65e6 < built.build == 640000
    assert built.fits is False and "the build does not fit" in built.notes[0]
    result = search_profile(profile, 8, batch_size=8, hardware=hw)
    assert any(d.reason.startswith("its build does not fit") for d in result.dropped)
    profile.built_on_meta = True
    on_meta = estimate(profile, plan, batch_size=8, hardware=hw)
    assert on_meta.build == pytest.approx(built.memory.parameters + 20000 * 4)
    assert on_meta.fits is True
    # Under tp the split is traced on a twin first: the layers outside the blocks and
    # one block, whole, and that block's reference gradients (parallel/tensor/meta.py),
    # freed before the rank's own part.
    outside = profile.total_params - profile.block_params
    block = max(b.params for b in profile.blocks)
    twin = (outside + 2 * block) * 4
    with_tp = estimate(profile, Plan(dp=1, fsdp=8, tp=2), batch_size=8, hardware=hw)
    share = max(r.parameters + r.host for r in with_tp.ranks) + 20000 * 4
    assert with_tp.build == pytest.approx(max(share, twin))
    assert twin > share  # this hand profile: the twin's phase is the peak


def test_search_picks_the_known_best_on_a_hand_made_cost_table():
    """With free communication, every plan computes the same FLOPs over the same
    devices; the pipeline's bubble and recomputation only add time. The best is
    therefore a plan without either, and the search must find exactly those on top."""
    result = search_profile(hand_profile(), 4, batch_size=8, hardware=fast_net_slow_chips())
    best = result.best
    assert best.plan.pp == 1 and best.plan.checkpointing == "none"
    assert not best.plan.offload
    ideal = 8 * 8 * 1e6 * 3 / 1e9 / 4  # samples x blocks x FLOPs x (fwd + bwd) / rate / devices
    assert best.step_time.compute == pytest.approx(ideal, rel=1e-6)


def test_search_prefers_tensor_parallel_inside_a_node_over_a_slow_network():
    """Slow links between nodes and a model that fits: data parallel across nodes
    pays the gradient all-reduce over the slow link. Check the search ranks a plan
    whose slow-link traffic is smaller above pure data parallel across nodes."""
    hw = Hardware("two nodes", 1e12, {"fp32": 1e12}, {"fp32": 1e12}, 1e12, 1e12, 1e6, 2,
                  nodes=2, latency=0.0, op_overhead=0.0)  # fmt: skip
    profile = hand_profile(params=1_000_000, flops=1e6)
    result = search_profile(profile, 4, batch_size=8, hardware=hw)
    dp4 = next(e for e in result.ranked if e.plan == Plan(dp=4))
    assert result.best.samples_per_s > 1.5 * dp4.samples_per_s


def test_search_drops_plans_the_batch_does_not_divide_and_says_why():
    result = search_profile(hand_profile(), 4, batch_size=6, hardware=fast_net_slow_chips())
    assert all(
        6 % (e.plan.data_parallel_size * e.plan.num_microbatches) == 0 for e in result.ranked
    )
    assert any("batch does not divide" in d.reason for d in result.dropped)
    assert "dropped:" in result.table()


def test_a_compiled_search_drops_zero_bubble_as_parallelize_refuses_it():
    def zero_bubble(result):
        return [e for e in result.ranked if e.plan.pp > 1 and e.plan.schedule == "zero-bubble"]

    hw = fast_net_slow_chips()
    assert zero_bubble(search_profile(hand_profile(), 4, batch_size=8, hardware=hw))
    compiled = search_profile(hand_profile(), 4, batch_size=8, hardware=hw, compiled=True)
    assert compiled.ranked and not zero_bubble(compiled)
    assert any("does not run zero-bubble" in d.reason for d in compiled.dropped)


@pytest.mark.slow
def test_planning_a_thousand_gpus():
    """A 96-layer GPT-3-shaped model on 1024 A100s: every plan costed, none that does
    not fit ranked (the time it takes is in BENCHMARKS.md, not asserted here)."""
    with torch.device("meta"):
        big = GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288))
    result = plan_search(
        big, 1024, batch_size=1536, example_inputs=torch.zeros(1, 2048, dtype=torch.long),
        hardware="a100-80gb", precision="bf16",
    )  # fmt: skip
    assert len(result.ranked) > 100
    assert all(e.fits for e in result.ranked)
    assert result.best.plan.world_size == 1024


# ---- auto --------------------------------------------------------------------------


def test_auto_fixes_the_fields_it_is_given():
    assert fixed_fields("auto") == {}
    assert fixed_fields("auto,precision=bf16,pp=1") == {"precision": "bf16"}  # pp=1 default
    choice = choose_plan(
        gpt(), "auto,checkpointing=full", batch_size=8, example_inputs=tokens(), world_size=4,
        hardware=hardware("cpu").with_nodes(1, 4),
    )  # fmt: skip
    assert choice.plan.checkpointing == "full" and choice.plan.world_size == 4
    assert "plan=auto chose" in choice.describe()


def test_auto_without_example_inputs_is_refused_with_the_fix():
    with pytest.raises(MeshfitError, match="example_inputs"):
        mf.parallelize(gpt(), "auto", loss_fn=F.cross_entropy)


def test_fit_with_auto_plan_in_one_process_records_prediction_and_measurement(tmp_path):
    model = gpt()
    x = torch.randint(0, 256, (16, CONFIG.block_size))

    def loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    history = mf.fit(model, (x, x), loss_fn=loss, batch_size=8, plan="auto", max_steps=4,
                     log_every=1, progress=False, checkpoint_dir=str(tmp_path))  # fmt: skip
    assert history.planned["plan"] == str(history.engine.plan)
    assert history.planned["memory_bytes"] > 0
    assert history.planned["measured_step_time_s"] > 0
    meta = json.loads(next(tmp_path.glob(f"step-*/{META_FILE}")).read_text())
    assert meta["extra"]["planned"]["plan"] == history.planned["plan"]


def test_unknown_hardware_is_refused_with_the_known_names():
    with pytest.raises(MeshfitError, match="a100-40gb"):
        hardware("tpu-v5")


# ---- the planner knows what meshfit refuses -------------------------------------------


@pytest.mark.slow
def test_the_planner_refuses_exactly_the_zoo_cells_meshfit_refuses():
    """Every (family, plan) cell of the model-zoo matrix (tests/test_model_zoo.py, which
    runs them): the planner drops a cell if and only if meshfit refuses it there. A plan
    the planner proposed and meshfit refused would stop plan="auto"."""
    pytest.importorskip("transformers")
    os.environ.setdefault("KERAS_BACKEND", "torch")
    pytest.importorskip("keras")
    from test_model_zoo import REFUSED
    from zoo import FAMILIES

    from meshfit.parallel.blocks import use_blocks
    from meshfit.planner.search import ModelLimits, why_refused

    disagreements = []
    for name, family in FAMILIES.items():
        torch.manual_seed(0)
        dtype = getattr(torch, family.dtype)
        model = family.build().to(dtype)
        if family.options and "blocks" in family.options:
            use_blocks(model, family.options["blocks"])
        batch = family.batch(8, 0)
        if isinstance(batch, dict):  # the model's own loss: the mapping, labels in it
            inputs, targets = batch, batch.get("labels", torch.zeros(8, dtype=torch.long))
        else:
            inputs, targets = batch
        inputs = mf.trees.map_tensors(
            inputs, lambda t, d=dtype: t.to(d) if t.is_floating_point() else t
        )
        limits = ModelLimits.of(
            profile_model(model, inputs, loss_fn=family.loss(), example_targets=targets)
        )
        for cell in ("dp=2", "fsdp=2", "tp=2", "pp=2", "dp=2,pp=2"):
            plan = Plan.parse(cell)
            plan = plan.resolve(2 if plan.dp is None else plan.world_size)
            planner = why_refused(plan, limits)
            meshfit = REFUSED.get((name, cell))
            if (planner is None) != (meshfit is None):
                disagreements.append((name, cell, planner, meshfit))
    assert not disagreements, disagreements


@pytest.mark.slow
def test_plan_auto_on_two_workers_trains_the_one_process_run():
    """Both workers plan on their own and must arrive at the same plan (or the run
    could not start); the run it trains is the one-process run. With a loss that
    couples the samples where meshfit cannot make it global (the batch's worst
    sequence), the planner keeps the batch whole: before, it chose data parallel,
    whose first step refused the loss."""
    from helpers import assert_same_run
    from workers import fit_run, fit_runs

    spec = {"model": "gpt4", "steps": 4, "batch": 8, "samples": 32}
    worst = {**spec, "loss": "worst_sequence"}
    refs = [fit_run({**s, "plan": "dp=1"}) for s in (spec, worst)]
    got = mf.launch(fit_runs, nproc=2, args=([{**s, "plan": "auto"} for s in (spec, worst)],))
    for run, ref in zip(got, refs, strict=True):
        assert Plan.parse(run["planned"]["plan"]).world_size == 2
        assert run["planned"]["measured_step_time_s"] > 0
        assert_same_run(run, ref)
    assert Plan.parse(got[1]["planned"]["plan"]).data_parallel_size == 1, got[1]["planned"]


@pytest.mark.slow
def test_the_network_probe_measures_a_bandwidth_between_two_workers():
    from meshfit.planner.hardware import measure_network

    reduce, p2p = measure_network(2, nbytes=2**20, repeats=3)
    assert 1e6 < reduce < 1e12 and 1e6 < p2p < 1e12  # bytes/s: loopback, any machine


def test_fit_logs_mfu_where_the_peak_is_known(monkeypatch):
    """MFU = 3 x forward FLOPs per sample x samples/s over the devices' peak. On CPU no
    peak is known and no MFU is shown; MESHFIT_PEAK_FLOPS gives one."""
    x = torch.randint(0, 256, (16, CONFIG.block_size))

    def loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    plain = mf.fit(gpt(), (x, x), loss_fn=loss, batch_size=8, max_steps=2, log_every=1,
                   progress=False)  # fmt: skip
    assert "mfu" not in plain.records[-1]
    monkeypatch.setenv("MESHFIT_PEAK_FLOPS", "1e9")
    history = mf.fit(gpt(), (x, x), loss_fn=loss, batch_size=8, max_steps=2, log_every=1,
                     progress=False)  # fmt: skip
    forward = profile_model(gpt("meta"), tokens(1), loss_fn=loss, example_targets=tokens(1))
    per_sample = 3 * (
        sum(b.flops for b in forward.blocks) + forward.head.flops + forward.tail.flops
    )
    last = history.records[-1]
    assert last["mfu"] == pytest.approx(per_sample * last["samples_per_s"] / 1e9, rel=1e-2)
    # plan="auto" hands its profile to the MFU meter (the model is profiled once)
    auto = mf.fit(gpt(), (x, x), plan="auto", loss_fn=loss, batch_size=8, max_steps=2,
                  log_every=1, progress=False)  # fmt: skip
    last = auto.records[-1]
    assert last["mfu"] == pytest.approx(per_sample * last["samples_per_s"] / 1e9, rel=1e-2)


def test_the_search_proposes_no_pipeline_stage_without_parameters():
    """A Sequential MLP's blocks are Linear, Tanh, Linear, Tanh, Linear: 5 blocks, 3 with
    parameters, and meshfit refuses a stage without any. plan="auto" on 2 processes
    chose pp=2 under an interleaved schedule (4 stages) and the run stopped (seen in
    the elastic test); every proposed plan now has at most 3 stages."""
    from meshfit.plan import VIRTUAL_STAGES

    profile = hand_profile(blocks=5)
    for i in (1, 3):
        profile.blocks[i] = dataclasses.replace(profile.blocks[i], params=0)
    profile.total_params = 3000
    result = search_profile(profile, 2, batch_size=8, hardware=fast_net_slow_chips())
    assert result.ranked
    staged = [e.plan for e in result.ranked if e.plan.pp > 1]
    assert staged and all(p.pp * VIRTUAL_STAGES[p.schedule] <= 3 for p in staged)
    assert any("needs 4 blocks with parameters" in d.reason for d in result.dropped)
    # frozen blocks count as none: a fine-tune with only its last block trained has one
    for i in (0, 2):
        profile.blocks[i] = dataclasses.replace(profile.blocks[i], trains=False)
    result = search_profile(profile, 2, batch_size=8, hardware=fast_net_slow_chips())
    assert all(e.plan.pp == 1 for e in result.ranked)


def test_the_planner_cuts_where_the_blocks_keep_their_arguments_as_the_cut_does():
    """EXAONE 4 (sliding-window and global layers alternating) and OLMo 3 (3 sliding
    layers, then a global one) pick each layer's mask by the loop's count, so a stage
    may start only where the pattern repeats (pipeline/arguments.py). The planner
    costed EXAONE 4's stages cut at block 3 and ranked pp=2 for OLMo 3, which meshfit
    refuses: it now cuts where meshfit's cut does, on the model built on the CPU and on
    meta, and drops the plans the cut would refuse, with its reason (both checked to
    fail on the old code)."""
    import warnings

    from context import BUILDS, batch_of

    from meshfit.parallel.blocks import find_blocks
    from meshfit.parallel.pipeline import balanced_starts, count_costs
    from meshfit.parallel.pipeline.costs import starts_keeping_arguments
    from meshfit.planner.memory import stage_layout

    warnings.simplefilter("ignore")  # the configs' own remarks on a tiny vocabulary
    model = BUILDS["exaone4_6"]()
    batch = batch_of("exaone4_6", "model", 0)
    counted = count_costs(model, find_blocks(model), batch)
    cut = balanced_starts(counted, 2, starts_keeping_arguments(counted, None))
    assert cut in ([0, 2], [0, 4])  # block 3 gives the second stage the other masks
    with torch.device("meta"):
        on_meta = BUILDS["exaone4_6"]()
    # (on meta without the padding mask: transformers reads its values, and the planner
    # plans a model on meta only where its forward runs there)
    unpadded = {k: batch[k] for k in ("input_ids", "labels")}
    for built, inputs in ((model, batch), (on_meta, unpadded)):
        profile = profile_model(built, inputs, loss_fn="model")
        assert profile.stage_starts == [True, False, True, False, True, False]
        layout = stage_layout(profile, Plan.parse("pp=2"))
        assert [blocks[0] for blocks, _, _ in layout] == cut
    result = search_profile(profile, 2, batch_size=8, hardware=fast_net_slow_chips())
    interleaved = [d for d in result.dropped if d.plan.schedule == "interleaved-1f1b"]
    assert any("only at blocks [0, 2, 4]" in d.reason for d in interleaved)
    assert not [e for e in result.ranked if e.plan.schedule == "interleaved-1f1b"]

    olmo = profile_model(BUILDS["olmo3"](), batch_of("olmo3", "model", 0), loss_fn="model")
    result = search_profile(olmo, 2, batch_size=8, hardware=fast_net_slow_chips())
    assert result.ranked and all(e.plan.pp == 1 for e in result.ranked)
    reasons = [d.reason for d in result.dropped if d.plan.pp == 2]
    assert reasons and all("may start only at blocks [0]" in r for r in reasons), reasons
    assert "block 3 gets another keyword 'attention_mask' than block 0" in reasons[0]
    with pytest.raises(MeshfitError, match="cannot cut this model into 2 stages"):
        estimate(olmo, "pp=2", batch_size=8, world_size=2)


# ---- context parallel ------------------------------------------------------------


def long_llama(length: int = 4096) -> ModelProfile:
    """A transformers Llama (grouped-query: 2 key/value heads of 4) profiled on meta at
    `length` tokens, one sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=length,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return profile_model(model, {"input_ids": torch.zeros(1, length, dtype=torch.long)})


def test_context_parallel_divides_activations_and_keeps_the_gathered_keys_and_values():
    """cp=N holds 1/N of each sequence's activations, plus every attention's keys and
    values of the whole sequence (gathered): the profile measures them (4096 tokens x 2
    heads x 16 x 4 bytes, keys and values: grouped-query attention's narrow K/V), and
    the additive mask of the rank's queries over every key."""
    p = long_llama()
    kv = 2 * 4096 * 2 * 16 * 4
    assert [b.attention_kv_bytes for b in p.blocks] == [kv, kv]
    hw = fast_net_slow_chips()
    alone = estimate(p, Plan(dp=1), batch_size=1, hardware=hw).memory.activations
    for cp in (2, 4):
        got = estimate(p, Plan(dp=1, cp=cp), batch_size=1, hardware=hw).memory.activations
        mask = 4096 / cp * 4096 * 4  # the rank's queries x every key, float32, one per step
        assert got == pytest.approx(alone / cp + 2 * kv * (1 - 1 / cp) + mask)
    # recomputation gathers them again in backward: one block's at a time
    full = estimate(p, Plan(dp=1, cp=2, checkpointing="full"), batch_size=1, hardware=hw)
    alone_full = estimate(p, Plan(dp=1, checkpointing="full"), batch_size=1, hardware=hw)
    expected = alone_full.memory.activations / 2 + kv / 2 + 2048 * 4096 * 4
    assert full.memory.activations == pytest.approx(expected)


def test_the_search_chooses_cp_when_a_sequence_does_not_fit_otherwise(monkeypatch):
    """Llama-3-8B's shape (transformers, bf16, on meta) at 131,072 tokens, a global batch
    of 8 sequences on 16 H100s: no plan that keeps whole sequences fits (the best needs
    several times a GPU); the plans that fit all cut the sequence. (BENCHMARKS.md has
    the table; benchmarks/planner_targets.py the same target for `meshfit plan`.)"""
    # for this test only: benchmarks/ left on sys.path made later launches' workers in
    # this pytest process import benchmarks/experts.py for tests/experts.py
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from planner_targets import llama3_8b

    from meshfit.planner.command import at_sequence_length

    model, batch, loss = llama3_8b()
    inputs, _ = at_sequence_length(batch, None, 131072)
    result = plan_search(
        model, 16, batch_size=8, example_inputs=inputs, loss_fn=loss, hardware="h100",
        precision="bf16",
    )  # fmt: skip
    assert result.ranked and all(e.plan.cp > 1 for e in result.ranked)
    unfit = [d for d in result.dropped if d.plan.cp == 1 and "does not fit" in d.reason]
    assert unfit and all("> 68.55 GiB (92% of 74.51 GiB)" in d.reason for d in unfit), unfit[0]
    # a model with no token sequence is never offered cp
    images = profile_model(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)), torch.zeros(2, 3, 8, 8)
    )
    plans = search_profile(images, 4, batch_size=4, hardware=fast_net_slow_chips())
    assert all(e.plan.cp == 1 for e in plans.ranked + plans.dropped)


def test_cp_is_never_offered_to_an_encoder_decoder():
    """A T5 at 4,096 tokens: its decoder's cross-attention reads the encoder's whole
    sequence, which cp does not gather (meshfit refuses cp for it: test_context.py);
    before, the search offered cp=2 and cp=4, which the run then refused."""
    pytest.importorskip("transformers")
    from zoo import hf_t5

    ids = torch.zeros(1, 4096, dtype=torch.long)
    with torch.device("meta"):  # profiled on meta (as a user builds a large model)
        model = hf_t5()
    profile = profile_model(model, {"input_ids": ids, "decoder_input_ids": ids})
    assert "is an encoder-decoder" in (profile.cp_error or "")
    plans = search_profile(profile, 4, batch_size=4, hardware=fast_net_slow_chips())
    cut = [d for d in plans.dropped if d.plan.cp > 1]
    assert all(e.plan.cp == 1 for e in plans.ranked) and cut
    assert all("cross-attention reads the encoder's whole sequence" in d.reason for d in cut)


def test_meshfit_plan_seq_len_lengthens_the_batch_and_plans_cp(capsys, monkeypatch, tmp_path):
    """`meshfit plan --seq-len N`: the batch's token tensors at N tokens (position ids
    counted again), the plans at that length, cp among them."""
    from meshfit.planner.command import at_sequence_length

    ids = torch.arange(6).reshape(1, 6)
    inputs, labels = at_sequence_length(
        {"input_ids": ids, "position_ids": ids, "pixel_values": torch.ones(1, 3)}, ids, 14
    )
    assert inputs["input_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert inputs["position_ids"].tolist() == [list(range(14))]
    assert labels.shape == (1, 14) and inputs["pixel_values"].shape == (1, 3)
    with pytest.raises(MeshfitError, match="--seq-len needs a batch of token ids"):
        at_sequence_length(torch.ones(2, 3), None, 8)
    (tmp_path / "longtarget.py").write_text(
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def fn():\n"
        "    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "        num_attention_heads=4, num_key_value_heads=2, vocab_size=128)\n"
        "    with torch.device('meta'):\n"
        "        model = LlamaForCausalLM(config)\n"
        "    ids = torch.zeros(2, 16, dtype=torch.long)\n"
        "    return model, {'input_ids': ids, 'labels': ids}, 'model'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from meshfit.cli import main

    assert main(["plan", "longtarget:fn", "--nproc", "4", "--seq-len", "65536", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "65,536 tokens per sequence" in out
    assumed = next(line for line in out.splitlines() if line.startswith("assuming: "))
    assert assumed.startswith("assuming: fp32 (the default on CPU workers"), assumed
    assert "8 bytes of optimizer state per parameter (AdamW, the default)" in assumed
    # a GPU preset plans bf16 unless told: what people train in
    assert main(["plan", "longtarget:fn", "--hardware", "h100", "--nodes", "1"]) == 1
    gpu = capsys.readouterr().out
    assert "assuming: bf16 (the default on GPUs; --precision fp32" in gpu
    assert "no plan fits: the global batch divides over no plan's" in gpu, gpu
    assert any(line.startswith("dp=1,cp=") or ",cp=" in line for line in out.splitlines())


# ---- expert parallel ------------------------------------------------------------


def test_expert_parallel_keeps_1_over_ep_of_the_experts_and_pays_their_all_to_alls():
    """A Qwen3-MoE shape profiled on meta: its experts found (elements, the pairs each
    layer sends: tokens x top-k x width x 2 bytes); ep=4 beside dp=4 keeps a quarter of
    them per rank (the rest of the model whole, as dp=4 alone keeps it all); its step
    pays the all-to-alls and saves the experts' gradient all-reduce; the search offers ep
    for this model and not for a dense one."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    with torch.device("meta"):  # bf16: torch._grouped_mm's meta kernel takes no other
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    p = profile_model(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    experts = 8 * (2 * 32 * 64 + 64 * 32)
    assert p.experts == 8 and [b.expert_params for b in p.blocks] == [experts, experts]
    assert p.blocks[0].dispatch_bytes == 16 * 2 * 64 * 2  # per sample
    # the experts' grouped products counted (torch's FlopCounterMode has no formula for
    # them: they counted 0): 16 tokens x top-2, each through (64 -> 2x32) and (32 -> 64)
    assert p.blocks[0].expert_flops == 16 * 2 * 2 * (64 * 64 + 32 * 64)
    assert p.blocks[0].flops > p.blocks[0].attention_flops + p.blocks[0].expert_flops
    # tp's derived plan splits the experts as a column/row pair (one all-reduce of the
    # block's two): beside ep, where tp leaves them whole, the step pays only attention's
    block = p.blocks[0]
    assert (block.tp_reductions, block.expert_tp_reductions) == (2, 1)
    assert (block.tp_projections, block.expert_tp_projections) == (6, 2)
    # the experts' weights never dispatch through DTensor (without ep tp runs their own
    # forward on the local shards, one all-reduce after them): 4 layers pay its overhead
    from meshfit.planner.estimate import _tp_counts

    assert _tp_counts(block, Plan(dp=4, tp=2)) == (2, 4)
    assert _tp_counts(block, Plan(dp=4, tp=2, ep=2)) == (1, 4)
    # and a pipeline cut balanced on FLOPs counts them (2 samples; attention as it runs)
    from meshfit.parallel.blocks import find_blocks
    from meshfit.parallel.pipeline import count_costs

    ids = {"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")}
    costs = count_costs(model, find_blocks(model), ids)
    assert costs.blocks[0] >= 2 * (p.blocks[0].flops - p.blocks[0].attention_flops)
    hw = dataclasses.replace(fast_net_slow_chips(), intra_node_bandwidth=1e6)
    alone = estimate(p, Plan(dp=4), batch_size=8, hardware=hw)
    placed = estimate(p, Plan(dp=4, ep=4), batch_size=8, hardware=hw)
    saved = (alone.memory.parameters - placed.memory.parameters) / p.param_bytes
    assert saved == pytest.approx(2 * experts * 3 / 4)
    # on a slow network: the all-to-alls cost the step's critical path, and the experts'
    # gradients, which dp=4 all-reduces whole, are not reduced at all (each on one rank)
    assert placed.step_time.compute > alone.step_time.compute
    assert placed.step_time.communication < alone.step_time.communication / 3
    # beside tp the experts stay whole, 1/ep of them per rank; the rest split by tp
    tp = estimate(p, Plan(dp=4, tp=2), batch_size=8, hardware=hw).memory.parameters
    both = estimate(p, Plan(dp=4, tp=2, ep=2), batch_size=8, hardware=hw).memory.parameters
    assert both == pytest.approx(tp)  # the experts / 2 either way
    quarter = estimate(p, Plan(dp=4, tp=2, ep=4), batch_size=8, hardware=hw).memory.parameters
    assert (tp - quarter) / p.param_bytes == pytest.approx(2 * experts * (1 / 2 - 1 / 4))
    beside = estimate(p, Plan(dp=4, tp=2, ep=4), batch_size=8, hardware=hw)
    assert beside.step_time.communication > 0  # was negative: the experts taken off twice
    # every tp rank computes and keeps the experts whole beside ep: more than tp alone,
    # which splits them; the FLOPs by exactly the half of the experts' tp no longer takes
    split = estimate(p, Plan(dp=4, tp=2), batch_size=8, hardware=hw)
    assert beside.memory.activations > split.memory.activations
    whole = sum(_block_flops(b, 2, experts_whole=True) for b in p.blocks)
    halved = sum(_block_flops(b, 2) for b in p.blocks)
    assert whole - halved == pytest.approx(sum(b.expert_flops for b in p.blocks) / 2, rel=0.05)
    result = search_profile(p, 4, batch_size=8, hardware=fast_net_slow_chips())
    assert {e.plan.ep for e in result.ranked} == {1, 2, 4}
    assert any(e.plan.pp > 1 for e in result.ranked if e.plan.ep > 1)  # ep beside pp
    roomy = dataclasses.replace(fast_net_slow_chips(), device_memory=1 << 30)
    roomier = search_profile(p, 4, batch_size=8, hardware=roomy)  # ep x tp needs 1.2 MiB
    assert any(e.plan.tp > 1 for e in roomier.ranked if e.plan.ep > 1)  # ep beside tp
    dense = search_profile(hand_profile(), 4, batch_size=8, hardware=fast_net_slow_chips())
    assert {e.plan.ep for e in dense.ranked} == {1}


def test_the_pp_check_refuses_a_residual_around_the_blocks_or_the_loop() -> None:
    """The cut's check forward, as the planner runs it (one process): a forward whose
    loop adds each block's input to its output, and transformers' ResNet bottleneck
    (the blocks found are its inner convolutions; it adds their input back after them),
    are refused under pp: a stage receives only what the block before it returned, and
    both trained another run with no word (4% and 7% apart under pp=2). The same MLP
    with the residual inside its blocks is not refused. So is a model that reads the
    earlier blocks' outputs after the last one."""
    from coupled import ResidualMLP, vectors
    from zoo import hf_resnet_bottleneck

    looped = profile_model(ResidualMLP(residual_in_loop=True), vectors()[0])
    assert "block 1 of 'blocks' an input made from block 0's input" in looped.pp_error
    resnet = profile_model(hf_resnet_bottleneck(), {"pixel_values": torch.randn(2, 3, 16, 16)})
    assert "'resnet.embedder.embedder.normalization' runs before the blocks" in resnet.pp_error
    assert profile_model(ResidualMLP(), vectors()[0]).pp_error is None
    # wav2vec2's audio classifier with use_weighted_layer_sum reads every layer's hidden
    # state after the layers (the first, the prologue's): before, its pp=2 run failed at
    # the first step, reported as the batch's fault ("give batches the model takes")
    from coupled import wav2vec2_batch, wav2vec2_ctc
    from transformers import Wav2Vec2ForSequenceClassification

    config = wav2vec2_ctc().config
    config.update({"use_weighted_layer_sum": True, "num_hidden_layers": 4, "num_labels": 3})
    classifier = Wav2Vec2ForSequenceClassification(config)
    audio = {k: v for k, v in wav2vec2_batch(2).items() if k != "labels"}
    weighted = profile_model(classifier, audio).pp_error
    assert "'wav2vec2.encoder.layer_norm' runs before the blocks" in weighted, weighted


def test_a_statistic_of_the_batch_the_forward_reads_is_planned_whole():
    """A VQ codebook kept by moving averages (tests/coupled.py): parallelize refuses a
    plan that splits its batch (tests/test_statistics.py), so plan="auto" must not
    choose one. The planner asks the same question of the forward: every ranked plan
    runs the batch whole (here pp=2 under GPipe with one micro-batch), the others are
    dropped naming the buffer, and the model's buffers are as they were."""
    from coupled import VQStack, vectors

    torch.manual_seed(0)
    model = VQStack().double()
    before = {name: b.clone() for name, b in model.named_buffers()}
    p = profile_model(model, vectors()[0])
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())
    assert p.split_error and "buffer 'vq.embed'" in p.split_error
    # in evaluation mode (as from_pretrained returns a model): asked in training mode
    assert profile_model(VQStack().double().eval(), vectors()[0]).split_error == p.split_error
    result = plan_search(p, 2, batch_size=8, hardware="cpu")
    assert result.ranked
    assert all(e.plan.data_parallel_size == 1 for e in result.ranked)
    assert all(e.plan.num_microbatches == 1 for e in result.ranked)
    assert any("buffer 'vq.embed'" in d.reason for d in result.dropped)


def test_a_loss_that_couples_the_samples_is_planned_whole():
    """The batch's largest sample loss couples the samples where meshfit cannot make it
    global: the first step of a plan that splits the batch refuses it
    (tests/test_coupling.py), so plan="auto" must not choose one. The planner asks the
    coupling probe's question of the loss_fn it is given: every ranked plan keeps the
    batch whole, the others are dropped saying why. A mean over the samples, and
    in-batch negatives (which meshfit gathers over the ranks), keep data parallel."""
    from coupled import FAMILIES, ResidualMLP, in_batch_negatives, vectors, worst_sample_loss

    x, y = vectors()
    model = ResidualMLP().double()
    coupled = profile_model(model, x, loss_fn=worst_sample_loss, example_targets=y)
    assert coupled.split_error.startswith("the loss couples the samples of a batch")
    result = plan_search(coupled, 2, batch_size=8, hardware="cpu")
    assert result.ranked
    assert all(e.plan.data_parallel_size == 1 for e in result.ranked)
    assert all(e.plan.num_microbatches == 1 for e in result.ranked)
    assert any("the loss couples the samples" in d.reason for d in result.dropped)
    mean = profile_model(model, x, loss_fn=F.cross_entropy, example_targets=y)
    assert mean.split_error is None
    ranked = plan_search(mean, 2, batch_size=8, hardware="cpu").ranked
    assert any(e.plan.data_parallel_size == 2 for e in ranked)
    pairs = FAMILIES["sentence_pairs"]
    inputs, targets = pairs.batch(8, 0)
    found = profile_model(
        pairs.build(), inputs, loss_fn=in_batch_negatives, example_targets=targets
    )
    assert found.split_error is None
