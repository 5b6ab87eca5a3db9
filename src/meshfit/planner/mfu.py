"""Model FLOPs utilisation in fit's log: the training FLOPs a step did over what the
devices could have done at their peak.

The numerator is 3 x the forward FLOPs of the model per sample (forward and a backward
of twice the work; recomputation not counted, as MFU's convention has it), from the
planner's profile of one forward on meta. The denominator is the devices' peak for the
plan's precision: a GPU that matches a preset (hardware.py) or MESHFIT_PEAK_FLOPS (FLOP/s
per device) for any other device. Where neither is known, fit shows no MFU.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from meshfit.errors import MeshfitError

PEAK_ENV = "MESHFIT_PEAK_FLOPS"


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's peak FLOP/s for `precision`, where it is known."""
    given = os.environ.get(PEAK_ENV)
    if given:
        try:
            return float(given)
        except ValueError:
            raise MeshfitError(
                f"{PEAK_ENV} must be a device's peak in FLOP/s, e.g. 989e12, not {given!r}"
            ) from None
    if device.type != "cuda":
        return None
    from meshfit.planner.hardware import this_machine

    try:
        # fp8's MFU is against the bf16 peak, as torchtitan reports it.
        return this_machine().peak_flops.get("bf16" if precision == "fp8" else precision)
    except MeshfitError:  # a GPU without a preset
        return None


def training_flops_per_sample(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Any,
    example_targets: Any,
    profile: Any = None,
) -> float | None:
    """3 x the model's forward FLOPs per sample (matrix products and attention), from
    `profile` where the run has one already (plan="auto" profiled the model)."""
    from meshfit.planner.profile import profile_model

    try:
        profile = profile or profile_model(
            model, example_inputs, loss_fn=loss_fn, example_targets=example_targets, tp=False
        )
    except Exception as error:  # MFU is a nicety: never stop a run over it
        warnings.warn(
            f"meshfit: no MFU in the log: profiling the model failed ({error})", stacklevel=3
        )
        return None
    forward = sum(b.flops for b in profile.blocks) + profile.head.flops + profile.tail.flops
    return 3 * forward
