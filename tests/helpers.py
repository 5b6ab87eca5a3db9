"""Numerical comparison used by every equivalence test, and the run specs they share.

Why the equivalence runs are in float64, and where the tolerances come from
-------------------------------------------------------------------------
A parallel plan computes the same sums as one process in another order (a gradient is
summed over ranks and micro-batches, a matrix product over shards), so the two runs
differ by float reassociation: a few units of roundoff `u` per operation, amplified by
the training steps that follow. That amplification is a property of the computation,
not of the float format, and we measure it: the largest per-tensor relative error of a
correct run, divided by `u`, is 119 in float64 over this whole suite (1.3e-14, gpt4 under
2-D plans; `MESHFIT_ERROR_LOG=errors.jsonl python -m pytest` records every comparison)
and was 171 in float32 (1.02e-5, gpt4 pp=4 on an AMD EPYC, the failure that moved these
tests to float64). AMPLIFICATION is the larger.

The tolerance is AMPLIFICATION x SAFETY x u. SAFETY = 100 covers kernels that reduce in
another order on another CPU (vector width, blocking; the float32 case above was 1.02x
its old tolerance on one CPU and inside it on another). In float64 that is 1.9e-12,
while a real bug (a gradient averaged over the wrong group, a micro-batch counted twice,
a replica out of sync) moves these runs' weights by 1e-4 or more, and a gradient off by
one part in a million moves them by 5e-7 (the negative controls in test_equivalence.py).
The same rule gives float32 1.0e-3: the float32 runs kept in the suite check the
float32 path, the float64 runs check the numbers; the old float32 tolerance of 1e-5 sat
at the noise floor of that format, which is why it passed on one CPU and not another.

Hugging Face's LlamaRMSNorm computes in float32 whatever its input, so a float64 Llama
run rounds there to float32. Two runs then differ only where their float64 inputs (1e-16
apart) round to different float32 values, a chance of about 1e-16 / 6e-8 ~ 2e-9 per
element; over these tiny runs (~1e4 such roundings) about 1e-5 per run. The Llama runs
keep the float64 tolerance (measured error 1.7e-16).

bf16 autocast rounds every matrix product's inputs to 8 significant bits (u = 2^-8); a
bf16 run is compared with float32 with an allowance stated in that test.
"""

from __future__ import annotations

import json
import os

import torch

# Unit roundoff (half the machine epsilon) of each float format.
ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
# Largest relative error of a correct run in units of roundoff: 119 measured in float64
# (this suite), 171 in float32 (issue 18). See the module docstring.
AMPLIFICATION = 171
SAFETY = 100  # other CPUs' reduction orders


def tolerance(dtype: torch.dtype | str = torch.float64) -> float:
    """Largest relative error a correct parallel run may show against one process."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return AMPLIFICATION * SAFETY * ROUNDOFF[dtype]


RTOL = tolerance(torch.float64)  # 1.9e-12


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, the tensor-wise relative error (elementwise relative error is
    meaningless for entries near zero)."""
    a, b = a.double(), b.double()
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


def _float_dtype(state: dict) -> torch.dtype:
    """The dtype a run trained in: that of its first floating-point tensor."""
    return next((t.dtype for t in state.values() if t.is_floating_point()), torch.float64)


def run_errors(got: dict, ref: dict) -> dict[str, float]:
    """The largest relative loss error and weight error between two runs."""
    losses = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True)]
    weights = [relative_error(got["state"][k], ref["state"][k]) for k in ref["state"]]
    return {"loss": max(losses, default=0.0), "weights": max(weights, default=0.0)}


def assert_same_run(got: dict, ref: dict, rtol: float | None = None) -> None:
    """Same per-step losses and same final weights, within `rtol` relative (by default
    the tolerance of the dtype the reference trained in)."""
    if rtol is None:
        rtol = tolerance(_float_dtype(ref["state"]))
    assert len(got["losses"]) == len(ref["losses"])
    _log_errors(got, ref, rtol)
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs {b}"
    assert got["state"].keys() == ref["state"].keys()
    for name in ref["state"]:
        err = relative_error(got["state"][name], ref["state"][name])
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.1e}"


def _log_errors(got: dict, ref: dict, rtol: float) -> None:
    """With MESHFIT_ERROR_LOG=path, append the comparison's errors there (one JSON line):
    how AMPLIFICATION above is measured."""
    path = os.environ.get("MESHFIT_ERROR_LOG")
    if not path:
        return
    record = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        "dtype": str(_float_dtype(ref["state"])).removeprefix("torch."),
        "rtol": rtol,
        "error": max(run_errors(got, ref).values()),
    }
    record["passed"] = record["error"] <= rtol  # the negative controls fail on purpose
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def max_weight_error(got: dict, ref: dict) -> float:
    return run_errors(got, ref)["weights"]


BATCH = 16  # global batch of an equivalence run
STEPS = 4  # optimizer steps of an equivalence run


def make_spec(model: str, plan: str, **extra) -> dict:
    """A run for workers.engine_run: `model` (a workers.build kind) under `plan`, in
    float64 unless `dtype=` says otherwise."""
    return {"model": model, "plan": plan, "batch": BATCH, "steps": STEPS, **extra}


def check_against_one_process(specs: list[dict], results: list[dict]) -> None:
    """Each result reproduces its spec run in this one process (losses, eval loss, final
    weights), and that run really trained (else equal weights would prove nothing)."""
    from workers import build, engine_run

    for spec, got in zip(specs, results, strict=True):
        # tp_plan / pp_split only say how the form splits: one process takes neither
        options = {
            k: v for k, v in spec.get("options", {}).items() if k not in ("tp_plan", "pp_split")
        }
        ref = engine_run({**spec, "plan": spec.get("reference_plan"), "options": options})
        rtol = spec.get("rtol") or tolerance(spec.get("dtype", "float64"))
        assert_same_run(got, ref, rtol)
        assert abs(got["eval"] - ref["eval"]) <= rtol * abs(ref["eval"]), spec
        initial = build(spec["model"], spec.get("dtype", "float64"))[0].state_dict()
        assert max(relative_error(ref["state"][k], initial[k]) for k in initial) > 1e-2
