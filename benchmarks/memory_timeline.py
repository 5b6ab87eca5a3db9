"""What is alive at a CUDA step's memory peak, and who made it: a summary of torch's
memory history (`torch.cuda.memory._record_memory_history`), small enough to bring back
from a lent GPU where the full snapshot (hundreds of MB) is not.

    callback = PeakAllocations(first=5, last=7)   # record steps 5 and 6
    mf.fit(..., callbacks=[callback]); callback.summary

The summary: the bytes allocated when recording began (parameters, optimizer state, what
earlier steps left), the peak over the recorded steps above that, and the largest
allocations alive at that moment, each with the frames that made it (meshfit's, the
model's, torch's Python; Inductor's generated code by its kernel's name), grouped where
the same code made several. `live_at_peak` works on the snapshot's trace alone, so it is
tested on the CPU with a made-up trace (tests/test_benchmarks.py).
"""

from __future__ import annotations

import os
from typing import Any

import meshfit as mf


def live_at_peak(trace: list[dict], top: int = 15) -> dict[str, Any]:
    """From one device's trace (the snapshot's `device_traces[i]`: events with "action",
    "addr", "size", "frames"), the highest running total of allocated bytes and the
    allocations alive then, largest first, grouped by the frames that made them."""
    best, best_at = _running_peak(trace)
    at_best = _live_after(trace[: best_at + 1])
    groups: dict[str, dict] = {}
    for event in at_best.values():
        where = _where(event.get("frames", []))
        group = groups.setdefault(where, {"where": where, "bytes": 0, "count": 0, "largest": 0})
        group["bytes"] += event["size"]
        group["count"] += 1
        group["largest"] = max(group["largest"], event["size"])
    ranked = sorted(groups.values(), key=lambda g: -g["bytes"])
    return {"peak_above_start_bytes": best, "alive_at_peak": ranked[:top]}


def _running_peak(trace: list[dict]) -> tuple[int, int]:
    """(highest running total of allocated bytes above where recording began, the index
    of the event that made it)."""
    sizes: dict[int, int] = {}
    total = best = 0
    best_at = -1
    for i, event in enumerate(trace):
        if event.get("action") == "alloc":
            sizes[event["addr"]] = event["size"]
            total += event["size"]
            if total > best:
                best, best_at = total, i
        elif event.get("action") == "free_completed":
            # a block made before recording began is freed too: its event has its size
            total -= sizes.pop(event["addr"], event.get("size", 0))
    return best, best_at


def _live_after(events: list[dict]) -> dict[int, dict]:
    """{address: its alloc event} of the allocations these events leave alive."""
    live: dict[int, dict] = {}
    for event in events:
        if event.get("action") == "alloc":
            live[event["addr"]] = event
        elif event.get("action") == "free_completed":
            live.pop(event["addr"], None)
    return live


def _where(frames: list[dict], depth: int = 4) -> str:
    """The innermost Python frames outside torch's own plumbing, innermost first."""
    kept = []
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith((".cpp", ".h", ".cu", ".cuh")) or name == "??":
            continue
        if "torch/_dynamo" in name or "torch/nn/modules/module.py" in name:
            continue
        kept.append(f"{os.path.basename(name)}:{frame.get('line', 0)} {frame.get('name', '')}")
        if len(kept) == depth:
            break
    return " < ".join(kept) or "(no Python frame)"


class PeakAllocations(mf.Callback):
    """Record CUDA memory history over steps [first, last) and keep `live_at_peak`'s
    summary in `.summary` (None off CUDA)."""

    def __init__(self, first: int, last: int, top: int = 15) -> None:
        self.first, self.last, self.top = first, last, top
        self.summary: dict | None = None
        self.started_bytes = 0

    def on_step_begin(self, step: int, engine) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        if step == self.first:
            torch.cuda.synchronize()
            self.started_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        elif step == self.last:
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snapshot["device_traces"][torch.cuda.current_device()]
            self.summary = {"allocated_at_start_bytes": self.started_bytes}
            self.summary |= live_at_peak(trace, self.top)
            print(f"memory at the peak of steps {self.first}-{self.last - 1}:", flush=True)
            print(
                f"  at start {self.started_bytes / 2**30:.2f} GiB, peak "
                f"+{self.summary['peak_above_start_bytes'] / 2**30:.2f} GiB above it",
                flush=True,
            )
            for group in self.summary["alive_at_peak"]:
                print(
                    f"  {group['bytes'] / 2**30:7.3f} GiB in {group['count']:4d} "
                    f"(largest {group['largest'] / 2**20:,.0f} MiB): {group['where']}",
                    flush=True,
                )
