"""Curves of a run as a PNG, with matplotlib (the `meshfit[plot]` extra):
`history.plot("run.png")` from Python, `meshfit plot RUN` from a run's files (a
log_dir's metrics.csv, a checkpoint_dir's history.jsonl, or either file itself)."""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

from meshfit.errors import MeshfitError

SKIPPED = {"step", "time", "lr", "samples_per_s", "tokens_per_s"}


def plot_records(records: list[dict[str, Any]], path: str, title: str | None = None) -> str:
    """Training loss (and eval loss) against the step; each other metric ("acc" with
    "eval_acc") in a panel of its own; the learning rate when it changes. Returns the
    path written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise MeshfitError(
            "plotting needs matplotlib: pip install matplotlib (or meshfit[plot])"
        ) from None
    if not records:
        raise MeshfitError("there is nothing to plot: the run has no records")
    names = [n for n in dict.fromkeys(k for r in records for k in r) if _plotted(n, records)]
    panels = [n for n in names if not n.startswith("eval_")]
    # the rate of each parameter group (LearningRateMonitor's lr/<group>) shares a panel
    rates = [k for k in dict.fromkeys(k for r in records for k in r) if k.startswith("lr/")]
    if any(len({r.get(k) for r in records}) > 1 for k in ["lr", *rates]):
        panels.append("lr")
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True)
    axes = [axes] if len(panels) == 1 else list(axes)
    for axis, name in zip(axes, panels, strict=True):
        curves = [(name, "-"), (f"eval_{name}", "o-")]
        if name == "lr" and rates:
            curves = [(k, "-") for k in rates]
        for shown, style in curves:
            points = [(r["step"], r[shown]) for r in records if _number(r.get(shown))]
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(steps, values, style, label=shown, markersize=3)
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        axis.legend(loc="best")
    axes[-1].set_xlabel("step")
    if title:
        axes[0].set_title(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def read_records(run: str) -> list[dict[str, Any]]:
    """The records of a run: from metrics.csv or history.jsonl, or a directory holding
    one of them."""
    if os.path.isdir(run):
        for name in ("metrics.csv", "history.jsonl"):
            if os.path.isfile(os.path.join(run, name)):
                return read_records(os.path.join(run, name))
        raise MeshfitError(
            f"{run!r} holds no metrics.csv (fit's loggers=['csv']) nor history.jsonl (a "
            f"checkpoint_dir); give one of them"
        )
    if not os.path.isfile(run):
        raise MeshfitError(f"no run at {run!r}: the path does not exist")
    if run.endswith(".csv"):
        with open(run, newline="") as f:
            return [{k: _parsed(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    with open(run) as f:
        return [json.loads(line) for line in f if line.strip()]


def _plotted(name: str, records: list[dict[str, Any]]) -> bool:
    return name not in SKIPPED and "/" not in name and any(_number(r.get(name)) for r in records)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parsed(text: str) -> Any:
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() and "." not in text and "e" not in text else number
