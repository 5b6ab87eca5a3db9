from __future__ import annotations

import pytest

from meshfit import MeshfitError, Plan


@pytest.mark.parametrize(
    "plan",
    [
        Plan(),
        Plan(dp=2),
        Plan(dp=2, tp=2),
        Plan(dp=1, fsdp=2, tp=2, pp=2, microbatches=8, schedule="gpipe"),
        Plan(dp=4, precision="bf16", checkpointing="full", offload=True),
        Plan(fsdp=4, reshard_after_forward=False),
    ],
)
def test_text_form_round_trips(plan: Plan) -> None:
    assert Plan.parse(str(plan)) == plan


def test_text_form_is_readable() -> None:
    assert str(Plan(dp=2, tp=2)) == "dp=2,tp=2"
    assert str(Plan()) == "dp=auto"
    assert Plan.parse("dp=2, precision=bf16") == Plan(dp=2, precision="bf16")


def test_resolve_fills_dp_from_world() -> None:
    assert Plan().resolve(4).dp == 4
    assert Plan(tp=2).resolve(8).dp == 4
    assert Plan(dp=2).resolve(2) == Plan(dp=2)


def test_plan_that_does_not_fit_the_world_names_the_fix() -> None:
    with pytest.raises(MeshfitError, match=r"uses 4 processes but 2 were started; use dp=2"):
        Plan(dp=4).resolve(2)
    with pytest.raises(MeshfitError, match="multiple of fsdp\\*tp\\*pp = 2"):
        Plan(tp=2).resolve(3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("tpp=2", "unknown plan field 'tpp'"),
        ("dp=two", "whole number"),
        ("dp=0", ">= 1"),
        ("schedule=fast", "schedule='fast' is not one of"),
        ("dp", "key=value"),
        ("dp=2,dp=4", "given twice"),
        ("precision=fp4", "precision='fp4' is not one of"),
    ],
)
def test_bad_plan_text_is_refused(text: str, message: str) -> None:
    with pytest.raises(MeshfitError, match=message):
        Plan.parse(text)


def test_every_product_of_degrees_is_built_and_clashing_options_are_refused() -> None:
    for plan in (
        Plan(dp=4, precision="bf16", microbatches=2),
        Plan(tp=4),
        Plan(pp=2),
        Plan(fsdp=2),
        Plan(dp=2, tp=2),
        Plan(dp=2, fsdp=2),
        Plan(dp=2, tp=2, pp=2),
        Plan(fsdp=2, tp=2, pp=2, dp=2),
        Plan(checkpointing="selective"),
        Plan(dp=2, offload=True),
        Plan(fsdp=2, reshard_after_forward=False),
        Plan(tp=2, reshard_after_forward=False),
        Plan(pp=2, schedule="zero-bubble"),
        Plan(dp=1, tp=2, pp=2, schedule="zero-bubble"),
        Plan(pp=2, microbatches=1, schedule="gpipe"),
        Plan(pp=2, microbatches=4, schedule="interleaved-1f1b"),
    ):  # dp unresolved: checked later
        plan.validate()
    refused = {
        Plan(dp=2, reshard_after_forward=False): "add fsdp=N",
        Plan(dp=1, tp=2, reshard_after_forward=False): "add fsdp=N",
        Plan(pp=2, precision="fp16"): "bf16",
        Plan(fsdp=2, precision="fp16"): "bf16",
        Plan(dp=2, tp=2, precision="fp16"): "FSDP2",
        Plan(dp=2, pp=2, schedule="zero-bubble"): "use schedule='interleaved-1f1b'",
        Plan(fsdp=2, pp=2, schedule="zero-bubble"): "partial gradients",
        # cp's gradients are averaged by DDP too (measured: 7.0e-4 from one process)
        Plan(dp=1, cp=2, pp=2, schedule="zero-bubble"): "not combine with context parallel",
        # the schedules' micro-batch counts: refused with the plan, before any worker builds
        Plan(pp=2, microbatches=1): "use microbatches=2 or more, or schedule='gpipe'",
        Plan(pp=4, microbatches=3, schedule="1f1b"): "at least as many micro-batches",
        Plan(pp=2, microbatches=3, schedule="interleaved-1f1b"): "use microbatches=2",
        Plan(pp=2, microbatches=5, schedule="zero-bubble", dp=1): "multiple of pp=2",
    }
    for plan, message in refused.items():
        with pytest.raises(MeshfitError, match=message):
            plan.validate()
    assert Plan(dp=2, tp=2).uses_fsdp and Plan(dp=2, offload=True).uses_fsdp
    assert not Plan(dp=2, pp=2).uses_fsdp and not Plan(dp=1, tp=2).uses_fsdp
    for plan in (
        Plan(dp=4, precision="bf16", microbatches=2),
        Plan(tp=4),
        Plan(pp=2),
        Plan(fsdp=2),
        Plan(fsdp=2, tp=2),
        Plan(tp=2, pp=2),
        Plan(checkpointing="selective"),
        Plan(dp=2, pp=2),
        Plan(fsdp=2, pp=2),
        Plan(fsdp=2, tp=2, pp=2),
    ):
        plan.validate()


def test_bf16_on_a_cpu_without_bf16_products_is_said_once(monkeypatch, capsys) -> None:
    """Where oneDNN has no bf16 kernels (no AVX-512), torch multiplies bf16 matrices in a
    scalar loop (94 s for one LM head's gradient at 128k words against 0.09 s): a user
    trying a GPU plan on such a CPU is told once why a step crawls, and what is faster."""
    import torch

    import meshfit as mf
    from meshfit.runtime import precision

    monkeypatch.setattr(precision, "_said_slow", False)
    monkeypatch.setattr(precision, "bf16_products_are_native", lambda: False)
    model = torch.nn.Linear(4, 4)
    for _ in range(2):
        mf.parallelize(model, "dp=1,precision=bf16", loss_fn=torch.nn.functional.mse_loss)
    said = [line for line in capsys.readouterr().out.splitlines() if "precision=bf16" in line]
    assert said == [
        "meshfit: precision=bf16 on this CPU: torch has no bf16 matrix products here "
        "(oneDNN has no bf16 kernels for it) and multiplies bf16 matrices in a scalar "
        "loop, 10-1000x slower than float32; the results are bf16's either way, only "
        "slower: precision='fp32' trains faster on this CPU"
    ]
    monkeypatch.setattr(precision, "_said_slow", False)
    monkeypatch.setattr(precision, "bf16_products_are_native", lambda: True)
    mf.parallelize(model, "dp=1,precision=bf16", loss_fn=torch.nn.functional.mse_loss)
    mf.parallelize(model, "dp=1", loss_fn=torch.nn.functional.mse_loss)
    assert "precision=" not in capsys.readouterr().out
