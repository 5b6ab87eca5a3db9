"""The planner's memory per rank against the measured peak of a real step.

Each plan trains meshfit's GPT on CPU workers and `memory_probe.measure_peak` counts the
live tensor bytes of one step on every rank (benchmarks/planner_memory.py, the same code
and model); `mf.estimate` predicts the fullest rank's peak for the same plan from one
forward on meta. Issue 12's bar: within 10% per plan, the 3-D plan (8 workers) included."""

from __future__ import annotations

import os
import sys

import pytest

# appended, not first: tests/experts.py must win over benchmarks/experts.py
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import planner_memory as bench  # noqa: E402


@pytest.mark.slow
def test_predicted_peak_memory_is_within_10_percent_of_the_measured_per_plan():
    plans = bench.PLANS
    assert len(plans) == 10  # one process x3, 2 workers x6, the 3-D plan on 8
    measured = bench.run_all(plans, bench.CONFIG)
    predicted = bench.predicted(plans)
    off = {r["plan"]: predicted[r["plan"]] / r["largest_rank"]["total"] - 1 for r in measured}
    print({plan: f"{100 * v:+.1f}%" for plan, v in off.items()})
    assert all(abs(v) <= 0.10 for v in off.values()), off


@pytest.mark.slow
def test_predicted_peak_with_the_loss_in_chunks_is_within_10_percent_of_the_measured():
    """benchmarks/planner_chunked.py: a transformers Llama with its own loss, float32
    and bf16, 32k and 128k words, the logits whole and in chunks (chunked_loss=True),
    eager, and the bf16 128k chunked step compiled, each beside `mf.estimate(...,
    chunked_loss=..., compiled=...)`; sequences of 256 tokens (the table's 512 halved for
    the suite's time: 1,024 tokens a step, two chunks at 128k words). Counted as whole,
    the chunked rows at 128k would be about twice the measured, so this checks the
    chunked count."""
    import planner_chunked as chunked
    from zero_products import replaced

    from meshfit.runtime.precision import bf16_products_are_native

    profiles: dict = {}
    rows = [
        chunked.run_one(vocab, precision, c, seq=256, profiles=profiles)
        for vocab in (32000, 128256)
        for precision in ("fp32", "bf16")
        for c in (False, True)
    ]
    compiled = chunked.run_one(128256, "bf16", True, compiled=True, seq=256, profiles=profiles)
    off = {
        (r["vocab"], r["plan"], r["chunked_loss"], r["compiled"]): (
            r["predicted_bytes"] / r["measured_peak_bytes"] - 1
        )
        for r in [*rows, compiled]
    }
    print({key: f"{v:+.1%}" for key, v in off.items()})
    assert all(abs(v) <= 0.10 for v in off.values()), off
    at_128k = [r for r in rows if r["vocab"] == 128256]
    whole, split = (
        [r["measured_peak_bytes"] for r in at_128k if r["chunked_loss"] is c] for c in (False, True)
    )
    logits = chunked.BATCH * 256 * 128256 * 4  # one float32 copy of the whole logits
    assert all(s < w - logits for w, s in zip(whole, split, strict=True))  # what chunks save
    # benchmarks/zero_products.py: where torch has no bf16 products of its own (no
    # AVX-512: this check took 58 minutes there), the bf16 rows are measured with the
    # products as zeros of their shape. Where it has them, both ways are the same bytes:
    # eager (a dispatch mode) and compiled (Inductor's extern kernels; its graphs cached)
    if bf16_products_are_native():
        before = dict(replaced)
        for row in (rows[2], compiled):  # 32k bf16 whole eager; 128k bf16 chunked compiled
            assert row["plan"] == "dp=1,precision=bf16", row
            zeros = chunked.measured_step(
                row["vocab"], row["plan"], row["chunked_loss"], row["compiled"], 256, True
            )
            assert zeros == row["measured_peak_bytes"], row
        assert all(replaced[way] > before[way] for way in replaced)  # the stand-in ran


@pytest.mark.slow
def test_the_last_stage_and_the_split_head_are_counted_within_10_percent() -> None:
    """benchmarks/planner_chunked.py --plans at 256 tokens and 32k words, on 2 workers:
    tp=2 with the chunks over each rank's half of the vocabulary (where the step peaks
    while AdamW steps, its temporaries beside the embedding), and pp=2 with 2
    micro-batches, the logits whole (torch's stage holds a micro-batch's output until its
    backward; meshfit asks the schedule not to keep every micro-batch's output for the
    step's end: with them kept, the measured peak here was 16% over the count) and in
    chunks."""
    import planner_chunked as chunked

    cases = [(32000, "tp=2", True), *((32000, "pp=2,microbatches=2", c) for c in (False, True))]
    rows = chunked.run_plans(cases, seq=256)
    off = {
        (r["plan"], r["chunked_loss"]): r["predicted_bytes"] / r["measured_peak_bytes"] - 1
        for r in rows
    }
    assert all(abs(v) <= 0.10 for v in off.values()), off


@pytest.mark.slow
def test_expert_parallel_plans_are_counted_within_10_percent() -> None:
    """benchmarks/planner_experts.py's 4-worker plans: a transformers Qwen3-MoE (float32,
    its default grouped-matmul experts, its own loss) under ep beside tp (each tp rank
    keeps the experts' activations whole), beside dp x fsdp (FSDP2 gathers the rest, not
    the experts: counted with them, the count was 44% over at dp=2,fsdp=2,ep=4) and pp;
    every peak within 10%. And the FLOPs the planner counts for one forward are the
    model's by hand: torch's FlopCounterMode has no formula for the experts' grouped
    products (nor for the CPU's attention kernel: parallel/flop_counts.py gives both): it
    counted 42% of them."""
    import planner_experts as moe

    plans = [(p, n) for p, n in moe.PLANS if n == 4 and "ep=" in p]
    assert len(plans) == 3
    measured = moe.run_all(plans)
    predicted = moe.predicted(plans)
    off = {p: predicted[p] / measured[p]["total"] - 1 for p, _ in plans}
    print({plan: f"{100 * v:+.1f}%" for plan, v in off.items()})
    assert all(abs(v) <= 0.10 for v in off.values()), off
    flops = moe.flop_counts()
    assert flops["planner"] == pytest.approx(flops["by_hand"], rel=1e-3), flops
    assert flops["planner_experts"] == pytest.approx(flops["experts_by_hand"], rel=1e-3), flops
    assert flops["torch"] < 0.5 * flops["by_hand"]  # what torch's counter alone sees
