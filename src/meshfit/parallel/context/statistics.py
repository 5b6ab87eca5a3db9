"""Buffers a training forward updates from the tokens it sees, under context parallel.

coupling/statistics.py asks, at the first step of a plan that splits the batch, whether
a buffer the training forward updates (a VQ codebook's moving averages, I-BERT's
activation ranges) is a statistic of the samples it sees. Context parallel splits no
batch: it cuts every sequence, so each cp rank would update such a buffer from its own
tokens where one process updates it from the whole sequence. The context-parallel probe
(probe.py) runs a window of the first sequence whole and cut: from the same buffers, a
buffer that ends other after this rank's tokens than after the whole window is such a
statistic. Then, with only those buffers at the whole window's values, the whole window
again: a loss that moves means the forward reads them.

Before, the cut pass started from the buffers the whole pass had updated: a codebook the
forward reads was refused as a cut that breaks the model, naming the LM head (whose
output moved), with the fix for attention; with the passes from the same buffers the cut
itself is exact, and only the statistic remains to refuse (or, not read, to say).
A buffer whose shape the pass changes is a cache sized by the sequence (a rotary table
grown to the window's length), not a statistic, and is not named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshfit.coupling.buffers import SavedBuffers
from meshfit.coupling.statistics import _named, _same
from meshfit.errors import MeshfitError


@dataclass
class TokenStatistics:
    """The buffers this probe found updated from each rank's tokens (every rank's
    names), and whether the forward reads them."""

    names: list[str] = field(default_factory=list)
    read: bool = False

    @property
    def found(self) -> bool:
        return bool(self.names)


class TokenStatisticsSeen:
    """Follows the probe's passes: each starts from the saved buffers (`restore` before
    it); what the whole pass and the cut pass left is compared after the cut."""

    def __init__(self, buffers: SavedBuffers) -> None:
        self.buffers = buffers
        self.names: list[str] = []
        self.first_whole: dict[str, torch.Tensor] | None = None  # the first window's
        self._whole: dict[str, torch.Tensor] = {}

    def whole_done(self) -> None:
        self._whole = self.buffers.current()
        if self.first_whole is None:
            self.first_whole = self._whole
        self.buffers.restore()

    def cut_done(self) -> None:
        cut, saved = self.buffers.current(), self.buffers.saved()
        for name, whole in self._whole.items():
            if name in self.names or name not in cut or name not in saved:
                continue
            if whole.shape != saved[name].shape or _same(whole, saved[name]):
                continue  # not updated by the pass, or a cache it resized
            if not _same(cut[name], whole):
                self.names.append(name)
        self.buffers.restore()

    def agreed(
        self, whole_loss: torch.Tensor, again: Callable[[], torch.Tensor], rounding: float
    ) -> TokenStatistics:
        """Every rank's names (the same on each), and whether the forward reads them:
        `again()` runs the first window whole, here from the buffers the whole pass left
        for those names (every rank runs it, or none: it may hold collectives)."""
        gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self.names)  # names from this run's ranks only
        names = list(dict.fromkeys(n for found in gathered for n in found))
        if not names:
            return TokenStatistics()
        whole = self.first_whole or {}
        self.buffers.restore({n: whole[n] for n in names if n in whole})
        moved = _relative(again(), whole_loss)
        self.buffers.restore()
        verdict = torch.tensor([moved], dtype=torch.float64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        # as the user names them: without data parallel's wrapper (DDP's `module.`)
        shown = [name.removeprefix("module.") for name in names]
        return TokenStatistics(names=shown, read=float(verdict[0]) > rounding)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0  # a window without targets: nothing to compare
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def refusal_line(statistics: TokenStatistics, cp: int) -> str:
    """The one line refusing cp for a statistic of the tokens the forward reads."""
    return (
        f"context parallel cannot cut this model's sequences: "
        f"{_named(statistics)} updated by the model's training forward from the "
        f"tokens it sees, and the forward reads it: from the same start it ends other "
        f"after a rank's tokens of the first sequence than after the whole sequence. cp={cp} "
        f"cuts each sequence over {cp} ranks, each would update it from its own tokens "
        f"where one process updates it from the whole sequence, and train another run. "
        f"Train this model without cp, or pass sync_batchnorm=False to let each rank keep "
        f"its own (not the one-process run)"
    )


def note_line(statistics: TokenStatistics, cp: int) -> str | None:
    """The start-up line on a statistic of the tokens (None: none)."""
    if not statistics.found:
        return None
    named = _named(statistics)  # type: ignore[arg-type] - it reads .names only
    if statistics.read:  # trained on under sync_batchnorm=False
        return (
            f"{named} updated by the training forward from the tokens it sees, and read "
            f"by it; cp={cp} cuts each sequence over {cp} ranks and sync_batchnorm=False "
            f"lets each keep its own, so this is not the one-process run"
        )
    return (
        f"{named} updated by the training forward from the tokens it sees (the loss does "
        f"not read it): cp={cp} cuts each sequence over {cp} ranks, each updating it from "
        f"its own tokens, so its values (saved, and read by evaluation) will differ from "
        f"one process's"
    )


def said_token_statistics(statistics: TokenStatistics, cp: int, coupling: Any) -> None:
    """Refuse a statistic of the tokens the forward reads (unless the run keeps each
    rank's own: sync_batchnorm=False, `coupling.own_statistics`), else say it once."""
    if not statistics.found:
        return
    if statistics.read and not getattr(coupling, "own_statistics", False):
        raise MeshfitError(refusal_line(statistics, cp))
    line = note_line(statistics, cp)
    if line and dist.get_rank() == 0:
        print(f"meshfit: {line}", flush=True)
