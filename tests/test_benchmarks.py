"""The benchmark scripts run (tiny sizes). Checks that they work, never a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cluster import cluster_unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each script starts its own Python (and workers): the whole suite's, not the everyday loop's.
pytestmark = pytest.mark.slow


def _run_quick(script: str, tmp_path, timeout: int = 180) -> tuple[str, dict]:
    """Run `benchmarks/<script> --quick`; return what it printed and the JSON it wrote."""
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads(out.read_text())


def test_overhead_benchmark_quick(tmp_path) -> None:
    stdout, written = _run_quick("overhead.py", tmp_path, timeout=120)
    rows = written["rows"]
    assert [r["runner"] for r in rows] == ["hand-written", "meshfit engine", "meshfit fit"]
    assert "vs hand" in stdout.splitlines()[-4]


def test_gpu_throughput_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("gpu_throughput.py", tmp_path, timeout=120)[1]["rows"]
    assert [r["runner"] for r in rows] == ["hand-written", "meshfit engine"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows)


def test_gpu_fp8_benchmark_quick(tmp_path) -> None:
    pytest.importorskip("torchao.float8", reason="the fp8 extra: pip install 'meshfit[fp8]'")
    pytest.importorskip("transformers")
    written = _run_quick("gpu_fp8.py", tmp_path, timeout=180)[1]
    rows = {r["precision"]: r for r in written["rows"]}
    assert rows["bf16"]["float8_linears"] == 0 < rows["fp8"]["float8_linears"]
    assert len(rows["fp8"]["losses"]) == written["steps"] and written["summary"]["loss"]["within"]


def test_gpu_llama_benchmark_quick(tmp_path) -> None:
    pytest.importorskip("transformers")
    rows = _run_quick("gpu_llama.py", tmp_path, timeout=240)[1]["rows"]
    assert [r["mode"] for r in rows] == ["eager", "compile"]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_data_parallel_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("data_parallel.py", tmp_path)[1]["rows"]
    assert [r["runner"] for r in rows] == [
        "hand-written DDP",
        "meshfit dp=N",
        "hand-written FSDP2",
        "meshfit fsdp=N",
    ]
    # The wire counter saw at least what the collectives must send (else it read nothing).
    assert all(r["vs_theory"] >= 0.99 for r in rows), rows


def test_pipeline_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("pipeline.py", tmp_path)[1]["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 2), ("1f1b", 2)]
    assert all(r["step_s"] > 0 and r["theory_s"] > r["ideal_s"] for r in rows)


def test_grad_clip_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("grad_clip.py", tmp_path)[1]["rows"]
    norms = [row["norm"] for row in rows.values() if "norm" in row]
    assert len(norms) >= 2 and max(norms) - min(norms) <= 1e-5 * max(norms), rows


def test_pipeline_memory_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("pipeline_memory.py", tmp_path)[1]["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    # Each stage keeps placeholders (a few bytes) where full copies would take kilobytes.
    assert all(r["kept_storage_bytes"] < 64 < r["full_copy_bytes"] for r in rows), rows


def test_planner_memory_benchmark_quick(tmp_path) -> None:
    plans = _run_quick("planner_memory.py", tmp_path)[1]["plans"]
    assert [p["plan"] for p in plans] == ["none", "checkpointing=full", "checkpointing=selective"]
    for p in plans:
        (r,) = p["ranks"]
        parts = ("parameters", "gradients", "optimizer", "other")
        assert r["total"] == sum(r[k] for k in parts) > 0, r
        # the engine's own count of the model state (AdamW's 0-dim step counts aside)
        assert r["parameters"] == r["check_parameters"], r
        assert 0 <= r["optimizer"] - r["check_optimizer"] < 1024, r
    assert plans[1]["largest_rank"]["other"] < plans[0]["largest_rank"]["other"]


def test_checkpoint_integrity_benchmark_quick(tmp_path) -> None:
    stdout, written = _run_quick("checkpoint_integrity.py", tmp_path, timeout=120)
    assert written["checkpoint_bytes"] > 0 and set(written["median_s"]) == {
        "save with checksums",
        "save without",
        "load",
    }
    assert "save overhead" in stdout


@pytest.mark.slow
def test_cluster_bandwidth_benchmark_quick(tmp_path) -> None:
    """2 namespaced hosts x 2 workers (tests/cluster.py): skipped without root or ip."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(reason)
    rows = _run_quick("cluster_bandwidth.py", tmp_path, timeout=300)[1]["rows"]
    assert [(r["link"], r["plan"]) for r in rows] == [("100mbit", "dp=4"), ("100mbit", "dp=2,tp=2")]
    assert all(r["median_s"] > 0 and min(r["host_mb_per_step"]) > 0 for r in rows)


def test_planner_gpu_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("planner_gpu.py", tmp_path, timeout=120)[1]["rows"]
    assert rows[0]["measured_step_s"] > 0 and rows[0]["predicted_step_s"] > 0


def test_planner_published_benchmark(tmp_path) -> None:
    """The published-runs table is produced, and its arithmetic row holds: ZeRO-3's
    model states for 7.5B parameters over 64 devices are 1.875 GB."""
    rows = _run_quick("planner_published.py", tmp_path, timeout=180)[1]["rows"]
    assert len(rows) == 10
    zero = next(r for r in rows if r["run"].startswith("ZeRO-3, 7.5B"))
    assert zero["predicted"] == 1.875


def test_tp_head_benchmark_quick(tmp_path) -> None:
    written = _run_quick("tp_head.py", tmp_path)[1]
    params = written["params_per_rank"]
    # the split head keeps half of its 512 x 16 weights on each of the 2 ranks
    assert params["whole"] - params["split"] == 512 * 16 // 2, params
    assert all(t > 0 for t in written["step_s_median"].values())


def test_planner_ranking_benchmark_quick(tmp_path) -> None:
    rows = _run_quick("planner_ranking.py", tmp_path, timeout=240)[1]["rows"]
    assert [r["plan"] for r in rows] == ["dp=2", "fsdp=2"]
    assert all(r["median_s"] > 0 and r["predicted_s"] > 0 for r in rows)


def test_meta_memory_benchmark_quick(tmp_path) -> None:
    written = _run_quick("meta_memory.py", tmp_path, timeout=300)[1]
    rows = {(r["plan"], r["how"]): r for r in written["rows"]}
    assert len(rows) == 12
    for how in ("meta", "meta+weights"):  # sharded from the start: below the CPU-built
        meta = max(r["peak"] for r in rows["fsdp=2", how]["ranks"])
        cpu = min(r["peak"] for r in rows["fsdp=2", "cpu"]["ranks"])
        assert meta < cpu, (how, meta, cpu)


def test_gpu_meta_memory_benchmark_quick(tmp_path) -> None:
    """The script behind the H200 table (a tiny Llama here, on the CPU): three rows, and
    its value checks hold exactly (meta = CPU-built, weights= = what was saved)."""
    written = _run_quick("gpu_meta_memory.py", tmp_path, timeout=300)[1]
    assert [r["how"] for r in written["rows"]] == ["cpu", "meta", "meta+weights"]
    assert all(value == 0 for value in written["checks"].values()), written["checks"]
    assert "model.safetensors.index.json" in written["rows"][0]["save_files"]


def test_memory_timeline_finds_what_is_alive_at_the_peak(monkeypatch) -> None:
    """benchmarks/memory_timeline.py reads a CUDA memory history on a lent GPU; here a
    made-up trace in the snapshot's format: the peak, and who holds it."""
    # for this test only: benchmarks/ ahead of tests/ would make later launches' workers
    # import benchmarks/experts.py for tests/experts.py (the same module name)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from memory_timeline import live_at_peak

    def event(action: str, addr: int, size: int, where: str = "") -> dict:
        frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}]
        frames += [{"filename": f"/m/{where}.py", "line": 7, "name": where}] if where else []
        return {"action": action, "addr": addr, "size": size, "frames": frames}

    trace = [
        event("free_completed", 99, 50),  # made before recording: 50 bytes fewer
        event("alloc", 1, 100, "chunk"),
        event("alloc", 2, 100, "chunk"),
        event("alloc", 3, 30, "head"),
        event("free_completed", 1, 100),
        event("alloc", 4, 500, "chunk"),  # the peak: 2, 3 and 4 alive, 99 gone
        event("free_completed", 4, 500),
        event("alloc", 5, 20, "late"),
    ]
    summary = live_at_peak(trace)
    assert summary["peak_above_start_bytes"] == 630 - 50
    (chunk, head) = summary["alive_at_peak"]
    assert (chunk["bytes"], chunk["count"], chunk["largest"]) == (600, 2, 500)
    assert chunk["where"].startswith("functional.py:1 linear < chunk.py:7 chunk")
    assert head["bytes"] == 30


def test_model_sweep_benchmark_quick(tmp_path) -> None:
    """Two transformers causal LMs under dp=2 and pp=2: each the one-process run."""
    written = _run_quick("model_sweep.py", tmp_path, timeout=300)[1]
    verdicts = {(r["type"], r["plan"]): r["verdict"] for r in written["rows"]}
    assert verdicts == {(t, p): "same" for t in ("llama", "gpt2") for p in ("dp=2", "pp=2")}
