"""What kind of loss a loss is, from its value on some samples together and on their two
halves: a sum over the samples (the halves add up to the whole), a mean over the real
targets (their means weighted by each half's count of targets that are not -100 give the
whole: `F.cross_entropy(ignore_index=-100)` over a collator's labels) or a plain mean
(weighted by the halves' rows). A plan that splits the batch trains the one-process run
of the first two only if it knows which it is (losses.SampleSum).

A mean over the real targets is counted two ways: over the targets as they stand, and
over each row's targets after its first (a loss that shifts the labels itself,
`logits[:, :-1]` against `labels[:, 1:]`, as most causal-LM scripts write it, given a
collator's labels that are the ids with -100 at the padding). Before, only the first
was asked, and such a loss, off from both by the rows' first real labels, was refused
as coupling the samples under dp and pp.

Two places ask, and both decide here: the coupling probe (probe.py), over a rank's first
samples before a plan that splits the batch trains, and a pipeline's last stage on its
first micro-batch (losses._decided_from_halves), where the probe cannot run the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshfit.trees import tensors_in

IGNORED = -100  # a collator's label for a token that does not count (torch's ignore_index)

# The largest relative difference between the loss together and the combination of its
# halves that is rounding: the same computation in another order (a smaller batch runs
# other kernel blockings). float64: measured 1e-16; float32: measured 4e-8 on the
# zoo's models; low precision (bf16/fp16 weights or autocast): 1e-3.
ROUNDING = {torch.float64: 1e-10, torch.float32: 2e-5}
LOW_PRECISION = 2e-2
# The rounding of the combination itself, far below ROUNDING (measured: 2e-8 to 6e-8 in
# float32 for a small Llama's own loss): where the plain mean is off by more than it and
# by CLEARLY times a count-weighted mean's distance, the count tells the two apart even
# within ROUNDING (a model near uniform, whose samples' losses hardly differ). Not for
# low precision, whose rounding is the limit's order.
NOISE = {torch.float64: 1e-13, torch.float32: 1e-6}
CLEARLY = 10.0

# As far as nothing is known: no sum, no count, a plain mean (a pair (sum, count), a loss
# that cannot take halves). The order of `distances`.
UNKNOWN = (1e9, 1e9, 0.0, 0.0, 1e9, 0.0)


@dataclass(frozen=True)
class Kind:
    """What `kind` found: a sum over the samples; a mean over the real targets
    (`counted`), over each row's targets after its first where `shifted`; or a plain
    mean although the halves' counts of real targets differ (`per_sample`: a mean of
    each sample's own mean, CTC's, exact as it stands)."""

    summed: bool = False
    counted: bool = False
    shifted: bool = False
    per_sample: bool = False


def rounding(dtype: torch.dtype | None, low_precision: bool = False) -> float:
    """The relative difference that is rounding for a loss of `dtype`."""
    return LOW_PRECISION if low_precision else ROUNDING.get(dtype, LOW_PRECISION)


def noise(dtype: torch.dtype | None, low_precision: bool = False) -> float | None:
    """The combination's own rounding for a loss of `dtype` (NOISE), None in low precision."""
    return None if low_precision else NOISE.get(dtype)


def real_targets(targets: Any, shifted: bool = False) -> torch.Tensor | None:
    """Where the first integer tensor of `targets` holds a real target (not -100), as
    booleans, without each row's first where `shifted`; None where `targets` holds no
    integer tensor (or, shifted, none with a sequence)."""
    found = [t for t in tensors_in(targets) if not t.is_floating_point()]
    if not found or (shifted and found[0].ndim < 2):
        return None
    return (found[0][:, 1:] if shifted else found[0]) != IGNORED


def real_counts(targets: Any, half: int, shifted: bool = False) -> tuple[float, float] | None:
    """The counts of real targets in rows [:half] and [half:] of `targets` where some of
    its targets are ignored (-100) and some are real; else None (the halves then weigh
    by their rows)."""
    real = real_targets(targets, shifted)
    if real is None or bool(real.all()):
        return None
    counts = float(real[:half].sum()), float(real[half:].sum())
    return counts if sum(counts) > 0 else None


def telling_split(targets: Any, rows: int) -> int:
    """The row, nearest the middle, that splits `targets` into halves whose shares of the
    real targets (counted either way) are not their shares of the rows: there a mean over
    the real targets and a plain mean differ. The middle where no row does. A pipeline's
    micro-batch of four whose middle split holds 6 and 6 real targets may hold 2 and 10
    after its first row."""
    middle = rows // 2
    if rows < 3:
        return middle
    per_row = []
    for shifted in (False, True):
        real = real_targets(targets, shifted)
        if real is not None and not bool(real.all()) and real.shape[:1] == (rows,):
            per_row.append(real.reshape(rows, -1).sum(1).double())
    for k in sorted(range(1, rows), key=lambda k: (abs(k - middle), k)):
        if any(float(r[:k].sum()) * rows != float(r.sum()) * k for r in per_row):
            return k
    return middle


def distances(whole: float, a: float, b: float, half: int, rows: int, targets: Any) -> torch.Tensor:
    """[sum's, count-weighted mean's, plain mean's distance, uneven, count-weighted
    mean's distance counted shifted, uneven shifted] for a loss of `whole` over `rows`
    samples and of `a` and `b` over rows [:half] and [half:] of `targets`: each distance
    relative to `whole`; `uneven` 1.0 where the halves' shares of the real targets are
    not their shares of the rows (else a mean over the real targets and a plain one
    agree here, and the halves cannot tell them apart). Without ignored targets a
    count-weighted mean is the plain one. float64, for an all_reduce(MAX) over ranks."""
    scale = max(abs(whole), 1e-12)
    plain = abs((half * a + (rows - half) * b) / rows - whole) / scale
    found = [abs(a + b - whole) / scale]
    for shifted in (False, True):
        counts = real_counts(targets, half, shifted)
        if counts is None:
            found += [plain, 0.0]
        else:
            counted = abs((a * counts[0] + b * counts[1]) / sum(counts) - whole) / scale
            found += [counted, float(counts[0] * (rows - half) != counts[1] * half)]
    summed, counted, uneven, counted_shifted, uneven_shifted = found
    return torch.tensor(
        [summed, counted, plain, uneven, counted_shifted, uneven_shifted], dtype=torch.float64
    )


def kind(off: Sequence[float] | torch.Tensor, limit: float, floor: float | None = None) -> Kind:
    """What `distances` (perhaps every rank's largest) say: a sum where the halves add up
    and no mean combines them; a mean over the real targets where a count-weighted mean
    combines them and the plain mean clearly does not, a plain mean where the reverse
    holds; neither where the two cannot be told apart (the step warns). Clearly: within
    `limit` against beyond it, or, where `floor` (the dtype's NOISE, far below `limit`)
    is given, beyond both it and CLEARLY times the other's distance. Counted as
    they stand or shifted, whichever is nearer (as they stand where both are the same)."""
    summed_off, counted, plain, uneven, counted_shifted, uneven_shifted = (float(d) for d in off)
    if summed_off <= limit < min(counted, plain, counted_shifted):
        return Kind(summed=True)
    found = [(counted, False)] if uneven > 0 else []
    found += [(counted_shifted, True)] if uneven_shifted > 0 else []
    if not found:  # even counts: the two means agree here, nothing to tell
        return Kind()
    # a loss that shifts its labels itself is off from the counts as they stand by one
    # label a row, which on a model still near uniform (every token's loss about
    # log(vocabulary)) is within float32's limit (measured: 1.8e-5 as they stand, 2.3e-8
    # shifted, 1.8e-4 the plain mean, on a small Llama's first two samples)
    off_by, shifted = min(found)

    def clearly(near: float, far: float) -> bool:
        beyond = limit if floor is None else max(floor, CLEARLY * near)
        return near <= limit and far > beyond

    if clearly(off_by, plain):
        return Kind(counted=True, shifted=shifted)
    return Kind(per_sample=clearly(plain, off_by))
