"""What kind of loss a loss is, from its value on some samples together and on their two
halves: a sum over the samples (the halves add up to the whole), a mean over the real
targets (their means weighted by each half's count of targets that are not -100 give the
whole: `F.cross_entropy(ignore_index=-100)` over a collator's labels) or a plain mean
(weighted by the halves' rows). A plan that splits the batch trains the one-process run
of the first two only if it knows which it is (losses.SampleSum).

A mean over the real targets is counted four ways (COUNTINGS): over the targets as they
stand, or over each row's targets after its first (a loss that shifts the labels itself,
`logits[:, :-1]` against `labels[:, 1:]`, as most causal-LM scripts write it, given a
collator's labels that are the ids with -100 at the padding); ignoring -100, or the
labels' own padding value (`ignore_index=pad_id`). Before, only the first was asked, and
such losses were refused as coupling the samples under dp and pp.

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

# The ways a mean over the real targets may count them: (shifted: after each row's
# first, padded: the padding's own value ignored, not -100). The order of `distances`.
COUNTINGS = ((False, False), (True, False), (False, True), (True, True))
NO_PADDING = -1e18  # `distances`' padding value and its negation where none is found


def padding_fields(padding: int | None) -> tuple[float, float]:
    """`distances`' padding value and its negation: every rank's largest of both is one
    value only where every rank that found padding found the same. A rank that found
    none (its rows all full, say) gives the least of both, so it disagrees with nobody:
    its counts of the real targets are its rows' whatever the padding is."""
    return (NO_PADDING, NO_PADDING) if padding is None else (float(padding), -float(padding))


# In the order of `distances`: as far as nothing is known, no sum, no count, a plain
# mean (a loss that cannot take halves); and neither a sum nor any mean (a pair).
UNKNOWN = (1e9, 0.0, *padding_fields(None)) + (1e9, 0.0) * len(COUNTINGS)
NEITHER = (1e9, 1e9, *padding_fields(None)) + (1e9, 0.0) * len(COUNTINGS)


@dataclass(frozen=True)
class Kind:
    """What `kind` found: a sum over the samples; a mean over the real targets
    (`counted`): those that are not `ignored`, after each row's first where `shifted`;
    or a plain mean although the halves' counts of real targets differ (`per_sample`: a
    mean of each sample's own mean, CTC's, exact as it stands)."""

    summed: bool = False
    counted: bool = False
    shifted: bool = False
    ignored: int = IGNORED
    per_sample: bool = False


def rounding(dtype: torch.dtype | None, low_precision: bool = False) -> float:
    """The relative difference that is rounding for a loss of `dtype`."""
    return LOW_PRECISION if low_precision else ROUNDING.get(dtype, LOW_PRECISION)


def noise(dtype: torch.dtype | None, low_precision: bool = False) -> float | None:
    """The combination's own rounding for a loss of `dtype` (NOISE), None in low precision."""
    return None if low_precision else NOISE.get(dtype)


def _first_integer(targets: Any) -> torch.Tensor | None:
    return next((t for t in tensors_in(targets) if not t.is_floating_point()), None)


def real_targets(
    targets: Any, shifted: bool = False, ignored: int = IGNORED
) -> torch.Tensor | None:
    """Where the first integer tensor of `targets` holds a real target (not `ignored`),
    as booleans, without each row's first where `shifted`; None where `targets` holds no
    integer tensor (or, shifted, none with a sequence)."""
    found = _first_integer(targets)
    if found is None or (shifted and found.ndim < 2):
        return None
    return (found[:, 1:] if shifted else found) != ignored


def padding_value(targets: Any) -> int | None:
    """The value the targets pad their rows with where it is not -100 (a script that
    labels with the ids, pads with the pad id and passes ignore_index=pad_id): the value
    most rows that end, or begin, with a run of two or more of one value (not -100) end
    or begin with; None where no row does."""
    ends = _runs_at_the_ends(targets)
    if ends is None:
        return None
    values = torch.cat([value[run] for value, run in ends])
    return int(values.mode().values) if values.numel() else None


def _runs_at_the_ends(targets: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """For each end of the rows (last, first) of the first integer tensor of `targets`:
    each row's value there and whether a run of two or more of it (not -100) is there;
    None where `targets` holds no [batch, sequence] integer tensor."""
    found = _first_integer(targets)
    if found is None or found.ndim != 2 or found.shape[1] < 2:
        return None
    return [
        (found[:, end], (found[:, end] == found[:, beside]) & (found[:, end] != IGNORED))
        for end, beside in ((-1, -2), (0, 1))
    ]


def clearly_padded(targets: Any) -> int | None:
    """padding_value where at least half the rows, and two or more, are padded with it
    (end or begin with a run of it): what a warning may name with no loss to tell it by.
    One row ending in a repeated token is a coincidence of the text, not padding."""
    value = padding_value(targets)
    if value is None:
        return None
    (last, run_last), (first, run_first) = _runs_at_the_ends(targets)
    rows = int(((run_last & (last == value)) | (run_first & (first == value))).sum())
    return value if rows >= 2 and 2 * rows >= len(last) else None


def real_counts(
    targets: Any, half: int, shifted: bool = False, ignored: int = IGNORED
) -> tuple[float, float] | None:
    """The counts of real targets in rows [:half] and [half:] of `targets` where some of
    its targets are `ignored` and some are real; else None (the halves then weigh by
    their rows)."""
    real = real_targets(targets, shifted, ignored)
    if real is None or bool(real.all()):
        return None
    counts = float(real[:half].sum()), float(real[half:].sum())
    return counts if sum(counts) > 0 else None


def _countings(padding: int | None) -> list[tuple[bool, int | None]]:
    """(shifted, the value ignored) for each of COUNTINGS, given the targets' padding
    value (padding_value); None where there is no padding."""
    return [(shifted, padding if padded else IGNORED) for shifted, padded in COUNTINGS]


def telling_split(targets: Any, rows: int) -> int:
    """The row, nearest the middle, that splits `targets` into halves whose shares of the
    real targets (counted any of the ways) are not their shares of the rows: there a mean
    over the real targets and a plain mean differ. The middle where no row does. A
    pipeline's micro-batch of four whose middle split holds 6 and 6 real targets may hold
    2 and 10 after its first row."""
    middle = rows // 2
    if rows < 3:
        return middle
    per_row = []
    for shifted, ignored in _countings(padding_value(targets)):
        real = None if ignored is None else real_targets(targets, shifted, ignored)
        if real is not None and not bool(real.all()) and real.shape[:1] == (rows,):
            per_row.append(real.reshape(rows, -1).sum(1).double())
    for k in sorted(range(1, rows), key=lambda k: (abs(k - middle), k)):
        if any(float(r[:k].sum()) * rows != float(r.sum()) * k for r in per_row):
            return k
    return middle


def distances(whole: float, a: float, b: float, half: int, rows: int, targets: Any) -> torch.Tensor:
    """[sum's distance, plain mean's distance, the padding value, its negation, then for
    each of COUNTINGS: the count-weighted mean's distance, uneven] for a loss of `whole`
    over `rows` samples and of `a` and `b` over rows [:half] and [half:] of `targets`:
    each distance relative to `whole`; `uneven` 1.0 where the halves' shares of the real
    targets are not their shares of the rows (else a mean over the real targets and a
    plain one agree here, and the halves cannot tell them apart). Without such targets a
    count-weighted mean is the plain one. float64, for an all_reduce(MAX) over ranks (the
    padding and its negation: padding_fields)."""
    scale = max(abs(whole), 1e-12)
    plain = abs((half * a + (rows - half) * b) / rows - whole) / scale
    padding = padding_value(targets)
    found = [abs(a + b - whole) / scale, plain, *padding_fields(padding)]
    for shifted, ignored in _countings(padding):
        counts = None if ignored is None else real_counts(targets, half, shifted, ignored)
        if counts is None:
            found += [plain, 0.0]
        else:
            counted = abs((a * counts[0] + b * counts[1]) / sum(counts) - whole) / scale
            found += [counted, float(counts[0] * (rows - half) != counts[1] * half)]
    return torch.tensor(found, dtype=torch.float64)


def _told(off: Sequence[float] | torch.Tensor) -> tuple[list[float], list[tuple[float, int]], int]:
    """(sum's and plain mean's distances, [(a count-weighted mean's distance, its index
    in COUNTINGS)] for those that may stand: uneven, and counting the padding only where
    every rank that found padding found the same, the padding value) from `distances`."""
    summed_off, plain, padding, negated, *counted = (float(d) for d in off)
    agreed = padding == -negated  # every rank that found padding found this (padding_fields)
    found = [
        (counted[2 * i], i)
        for i, (_, padded) in enumerate(COUNTINGS)
        if counted[2 * i + 1] > 0 and (agreed or not padded)
    ]
    return [summed_off, plain], found, int(padding) if agreed else IGNORED


def explained(off: Sequence[float] | torch.Tensor) -> float:
    """The nearest distance of a count-weighted mean that may stand (`distances`, every
    rank's largest): a mean over targets with ignored entries, whose halves weigh their
    real targets by their own counts, combines so, not as the plan's plain mean."""
    _, found, _ = _told(off)
    return min((d for d, _ in found), default=1e9)


def kind(off: Sequence[float] | torch.Tensor, limit: float, floor: float | None = None) -> Kind:
    """What `distances` (perhaps every rank's largest) say: a sum where the halves add up
    and no mean combines them; a mean over the real targets where a count-weighted mean
    combines them and the plain mean clearly does not, a plain mean where the reverse
    holds; neither where the two cannot be told apart (the step warns). Clearly: within
    `limit` against beyond it, or, where `floor` (the dtype's NOISE, far below `limit`)
    is given, beyond both it and CLEARLY times the other's distance. Of the countings
    the nearest (the earlier of COUNTINGS where two are the same)."""
    (summed_off, plain), found, padding = _told(off)
    counted = [float(d) for d in off][4::2]
    if summed_off <= limit < min([plain, *counted]):
        return Kind(summed=True)
    if not found:  # even counts: the two means agree here, nothing to tell
        return Kind()
    # a loss that shifts its labels itself is off from the counts as they stand by one
    # label a row, which on a model still near uniform (every token's loss about
    # log(vocabulary)) is within float32's limit (measured: 1.8e-5 as they stand, 2.3e-8
    # shifted, 1.8e-4 the plain mean, on a small Llama's first two samples)
    off_by, i = min(found)

    def clearly(near: float, far: float) -> bool:
        beyond = limit if floor is None else max(floor, CLEARLY * near)
        return near <= limit and far > beyond

    if clearly(off_by, plain):
        shifted, padded = COUNTINGS[i]
        return Kind(counted=True, shifted=shifted, ignored=padding if padded else IGNORED)
    return Kind(per_sample=clearly(plain, off_by))
