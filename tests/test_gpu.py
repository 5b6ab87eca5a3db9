"""Checks that need a CUDA GPU (skipped without one; CI has none). Run them on a GPU
machine with `python -m pytest tests/test_gpu.py`."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_run
from workers import engine_run, offload_memory_run

import meshfit as mf

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: offload moves model state between GPU and CPU memory, and "
    "FSDP2's CPU offload refuses to run without an accelerator",
)


def test_offload_keeps_the_model_state_in_cpu_memory_and_the_same_run() -> None:
    """One worker on the GPU with offload=True: the same losses and weights as a plain
    GPU run, and between steps the parameters, gradients and AdamW state are on the CPU
    (the GPU holds next to nothing while the model is idle)."""
    spec = {
        "model": "gpt4",
        "plan": "offload=true",
        "batch": 16,
        "steps": 4,
        "optimizer": "adamw",
        "grad_clip": 0.05,
    }
    got = mf.launch(offload_memory_run, nproc=1, args=(spec,))
    ref = engine_run({**spec, "plan": None})
    assert_same_run(got, ref, rtol=1e-4)  # the optimizer step runs on the CPU here
    assert got["state_devices"] == ["cpu"], got["state_devices"]
    assert got["gpu_bytes_between_steps"] < 0.1 * got["state_bytes"], got
