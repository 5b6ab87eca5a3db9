"""memory_probe.measure_peak: known allocations give known peaks, model state is filed
under the right category with exact byte counts, and one-process engine steps agree with
torch's own MemTracker where that tool works. Single process, a few seconds."""

from __future__ import annotations

import pytest
import torch
from workers import build, make_batch, optimizer_factory

import meshfit as mf
from meshfit.planner.memory_probe import measure_peak, profiled_peak

F32 = 4


def test_known_allocations_give_a_known_peak() -> None:
    kept = []

    def step() -> None:
        a = torch.empty(1000)  # 4,000 B
        b = torch.empty(2000)  # 8,000 B: 12,000 live, the peak
        kept.append(b[:10])  # a view keeps b alive; it adds no bytes
        del a
        c = torch.empty(500)  # 2,000 B: 10,000 live
        del c

    peak = measure_peak(step)
    assert peak.total == peak.other == 12_000
    assert peak.parameters == peak.gradients == peak.optimizer == 0


def test_a_buffer_only_written_in_place_counts_from_the_start() -> None:
    # Like DDP's gradient buckets: made before the step, never an operator's output in it.
    bucket = torch.zeros(1000)

    def step() -> None:
        temp = torch.ones(1000)  # 4,000 B
        bucket.add_(temp)
        del temp

    peak = measure_peak(step)
    assert peak.total == 8_000 and peak.before == 4_000


def test_a_temporary_made_out_of_sight_counts_from_where_it_is_met() -> None:
    # Like gloo's copy inside reduce_scatter_single: made by C++ without an operator the
    # probe sees, used, freed inside the call. Counted from the start it would overlap a.
    from torch.utils._python_dispatch import _disable_current_modes

    def step() -> None:
        a = torch.empty(1000)  # 4,000 B, freed before the hidden one exists
        del a
        with _disable_current_modes():
            hidden = torch.empty(2000)  # 8,000 B
        hidden.add_(1)
        del hidden

    peak = measure_peak(step)
    assert peak.total == 8_000 and peak.before == 0


def test_storage_resize_is_followed() -> None:
    # FSDP2 frees and refills its gathered parameters with storage.resize_.
    t = torch.empty(1000)
    storage = t.untyped_storage()

    def step() -> None:
        storage.resize_(0)
        torch.empty(250)  # 1,000 B while t's storage is empty
        storage.resize_(3000 * F32)  # 12,000 B
        storage.resize_(0)

    peak = measure_peak(step)
    assert peak.total == 12_000 and peak.before == 4_000


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_model_state_is_exact(optimizer: str) -> None:
    # Wide layers, a batch of 2: the peak is in the optimizer step, every gradient alive.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = optimizer_factory(optimizer)(model.parameters())
    x, y = torch.randn(2, 64), torch.randint(0, 8, (2,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the first step makes the optimizer state
    peak = measure_peak(step, modules=[model], optimizers=[opt])
    param_bytes = sum(p.numel() for p in model.parameters()) * F32
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert peak.parameters == param_bytes
    assert peak.gradients == param_bytes
    # SGD+momentum: one buffer per parameter; AdamW: two, and a 0-dim float32 step count
    per_param = {"sgd": 1, "adamw": 2}[optimizer]
    assert peak.optimizer == per_param * param_bytes + (4 * F32 if optimizer == "adamw" else 0)
    assert peak.optimizer == sum(v.numel() * v.element_size() for v in state)
    if optimizer == "adamw":  # foreach AdamW's temporaries put the peak in its step
        assert peak.phase == "optimizer"
    assert peak.total == peak.parameters + peak.gradients + peak.optimizer + peak.other


def _engine(plan: str | None) -> tuple[mf.Engine, tuple[torch.Tensor, torch.Tensor]]:
    model, loss_fn = build("gpt4", "float32")
    engine = mf.parallelize(model, plan, optimizer=optimizer_factory("adamw"), loss_fn=loss_fn)
    batch = make_batch("gpt4", 16, 0, "float32")
    engine.step(batch)
    return engine, batch


def test_engine_step_recomputation_keeps_fewer_activations() -> None:
    peaks = {}
    for plan in (None, "checkpointing=full"):
        engine, batch = _engine(plan)
        peaks[plan] = measure_peak(lambda: engine.step(batch), engine=engine)  # noqa: B023
    none, full = peaks[None], peaks["checkpointing=full"]
    params = list(engine.parallel_model.parameters())
    param_bytes = sum(p.numel() for p in params) * F32
    assert none.parameters == full.parameters == param_bytes
    # AdamW: exp_avg and exp_avg_sq, and a 0-dim float32 step count per parameter
    assert none.optimizer == full.optimizer == 2 * param_bytes + len(params) * F32
    assert full.other < none.other


def test_engine_step_agrees_with_torch_memtracker() -> None:
    # An independent count where torch's tool works (one call of the model per step).
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    engine, batch = _engine(None)
    ours = measure_peak(lambda: engine.step(batch), engine=engine)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(engine.parallel_model, engine.optimizer)
    with tracker:
        engine.step(batch)
    (theirs,) = (s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    # MemTracker does not count the batch (never an operator's output in the step)
    batch_bytes = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in batch}.values()
    )
    assert ours.total - batch_bytes == theirs


def test_engine_step_agrees_with_the_profilers_allocation_events() -> None:
    # torch.profiler's memory profile counts the allocator's events: the same total.
    engine, batch = _engine(None)
    ours = measure_peak(lambda: engine.step(batch), engine=engine)
    assert profiled_peak(lambda: engine.step(batch)) == ours.total
