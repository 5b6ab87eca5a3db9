"""Metrics besides the loss (accuracy, ...), over the GLOBAL batch under every plan.

`parallelize(..., metrics={"acc": fn})`: `fn(outputs, targets)` sees what `loss_fn`
sees, on every micro-batch, where the loss is computed (the last pipeline stage under
pp). It returns a mean over the micro-batch's samples, or a pair `(sum, count)` (e.g.
correct tokens and real tokens, for a masked target). meshfit keeps each as (sum,
count) in float64 (a mean is weighted by the micro-batch's sample count), sums them
over micro-batches and data-parallel ranks in one all-reduce, and divides: the value
one process gets on the whole batch. `engine.last_metrics` holds the results of the
last step or evaluation; `fit` puts them in its records ("acc", "eval_acc").

Under context parallel each rank holds part of every sequence: a metric must return a
pair over tokens (a mean over a rank's samples is refused: it would weigh each rank's
share of a sequence, not the sequence), and where the loss shifts next-token targets
meshfit shifts them before the cut, so the metric gets them shifted, as
`next_token_accuracy` expects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from meshfit.errors import MeshfitError
from meshfit.trees import tensors_in

if TYPE_CHECKING:
    from meshfit.runtime.runners import Runner
    from meshfit.topology import Topology

Metric = Callable[[Any, Any], Any]


def check_metrics(metrics: Any) -> dict[str, Metric]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping) or not all(
        isinstance(k, str) and callable(v) for k, v in metrics.items()
    ):
        raise MeshfitError(
            f"metrics must be a dict of name -> fn(outputs, targets), e.g. "
            f"{{'acc': mf.metrics.accuracy}}, not {metrics!r}"
        )
    clash = [k for k in metrics if k in ("loss", "lr", "step", "time") or k.startswith("eval_")]
    if clash:
        raise MeshfitError(
            f"metric name(s) {clash} clash with fit's own record fields; rename them"
        )
    return dict(metrics)


class MetricTap:
    """loss_fn, with the metrics computed beside it (without gradients) on each call."""

    deferred_head = "metrics"  # they read the logits: chunked_loss=True cannot apply

    def __init__(self, loss_fn: Callable[[Any, Any], Any], metrics: dict[str, Metric]) -> None:
        self.loss_fn = loss_fn
        self.metrics = metrics
        self.calls: list[torch.Tensor] = []  # per call: [sum_1, count_1, sum_2, ...]
        self.sequence_cut = False  # context parallel (parallel/context/): pairs only

    def __getattr__(self, name: str) -> Any:  # the wrapped loss's own attributes
        return getattr(self.__dict__["loss_fn"], name)

    def __call__(self, outputs: Any, targets: Any) -> Any:
        found = tensors_in(outputs)
        device = found[0].device if found else torch.device("cpu")
        with torch.no_grad():  # kept on the device: no sync per micro-batch
            values = []
            for name, fn in self.metrics.items():
                value = fn(outputs, targets)
                if self.sequence_cut and not _is_pair(value):
                    raise MeshfitError(
                        f"metric {name!r} returns a mean, and under context parallel each "
                        f"rank holds part of every sequence, so a mean over its samples is "
                        f"not the one-process value; return a pair (sum, count) over tokens, "
                        f"as mf.metrics.accuracy does, or train without cp"
                    )
                values += _as_pair(value, targets, name, device)
            self.calls.append(torch.stack(values))
        return self.loss_fn(outputs, targets)

    def take(self, calls: int, device: torch.device) -> torch.Tensor:
        """The sum of the last `calls` calls' values (the first pipeline step also calls
        the loss once for torch's metadata forward), then forget them all."""
        kept = self.calls[len(self.calls) - calls :] if calls else []
        self.calls.clear()
        if not kept:
            return torch.zeros(2 * len(self.metrics), dtype=torch.float64, device=device)
        return torch.stack(kept).sum(0).to(device)


def reduce_metrics(
    tap: MetricTap, calls: int, runner: Runner, topology: Topology
) -> dict[str, torch.Tensor]:
    """The global value of each metric for this step: this rank's sums, brought from the
    rank that computed the loss (the last pipeline stage), summed over the data-parallel
    ranks, divided."""
    local = tap.take(calls, topology.device)
    runner.from_loss_rank(local)
    total = topology.batch_sum(local)
    sums, counts = total[0::2], total[1::2]
    means = sums / counts.clamp_min(1)
    return dict(zip(tap.metrics, means.unbind(), strict=True))


def _is_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2


def _as_pair(value: Any, targets: Any, name: str, device: torch.device) -> list[torch.Tensor]:
    if _is_pair(value):
        total, count = value
        return [_scalar(total, name, device), _scalar(count, name, device)]
    samples = tensors_in(targets)[0].shape[0] if tensors_in(targets) else 1
    count = torch.tensor(float(samples), dtype=torch.float64, device=device)
    return [_scalar(value, name, device) * samples, count]


def _scalar(value: Any, name: str, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value, device=device).detach()
    if tensor.numel() != 1:
        raise MeshfitError(
            f"metric {name!r} returned a tensor of shape {tuple(tensor.shape)}; return one "
            f"number (the micro-batch's mean) or a pair (sum, count)"
        )
    return tensor.reshape(()).to(device, torch.float64)


def accuracy(outputs: Any, targets: torch.Tensor, ignore_index: int = -100) -> tuple:
    """Share of targets whose arg-max prediction is right, as (correct, counted); the
    logits are `outputs` or `outputs.logits`; targets equal to ignore_index are skipped."""
    logits = getattr(outputs, "logits", outputs)
    keep = targets != ignore_index
    correct = (logits.argmax(-1) == targets) & keep
    return correct.sum(), keep.sum()


def next_token_accuracy(outputs: Any, labels: torch.Tensor, ignore_index: int = -100) -> tuple:
    """`accuracy` of the prediction at each position against the next position's label,
    for labels as Hugging Face collators give them (unshifted; what
    `mf.losses.cross_entropy(shift=True)` and `loss_fn="model"` take). Under context
    parallel meshfit has shifted them before the cut (the next token may be on another
    rank), and this compares position by position there."""
    from meshfit.losses import _preshifted

    logits = getattr(outputs, "logits", outputs)
    if not _preshifted():
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    return accuracy(logits, labels, ignore_index)
