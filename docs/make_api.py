"""Write docs/api.md, the API reference, from the public objects' own docstrings.

    python docs/make_api.py          # rewrite docs/api.md
    python docs/make_api.py --check  # exit 1 if docs/api.md is not what the code says

tests/test_docs.py runs the check, so a changed signature or docstring without a
regenerated reference fails the suite.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import meshfit as mf
import meshfit.planner as planner

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "api.md")

# (section title, module, names): what a user imports, in the order they meet it.
SECTIONS: list[tuple[str, Any, list[str]]] = [
    ("Plans and the engine", mf, ["Plan", "parallelize", "Engine"]),
    ("The training loop", mf, ["fit", "History"]),
    (
        "Callbacks and loggers",
        mf,
        [
            "Callback",
            "EarlyStopping",
            "BestCheckpoint",
            "LearningRateMonitor",
            "CSVLogger",
            "TensorBoardLogger",
            "WandbLogger",
        ],
    ),
    ("Losses that couple the samples of a batch", mf, ["gather_batch", "batch_sum"]),
    ("Inference", mf, ["predict"]),
    ("Checking a plan", mf, ["verify", "VerifyReport"]),
    ("Launching", mf, ["launch", "WorkerError", "place"]),
    (
        "The planner",
        planner,
        [
            "estimate",
            "plan_search",
            "Estimate",
            "MemoryEstimate",
            "TimeEstimate",
            "SearchResult",
            "Hardware",
            "hardware",
            "this_machine",
            "measure",
            "profile_model",
            "ModelProfile",
        ],
    ),
    ("Errors", mf, ["MeshfitError"]),
]


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _entry(module: Any, name: str) -> list[str]:
    obj = getattr(module, name)
    kind = "class" if inspect.isclass(obj) else "function"
    where = f"{module.__name__}.{name}"
    lines = [f"### `{where}`", "", "```python", f"{kind} {name}{_signature(obj)}", "```", ""]
    doc = inspect.getdoc(obj) or "(no docstring)"
    lines += [doc, ""]
    if inspect.isclass(obj):
        for attr, member in inspect.getmembers(obj):
            if attr.startswith("_") or attr not in obj.__dict__:
                continue
            if not (inspect.isfunction(member) or isinstance(obj.__dict__[attr], property)):
                continue
            member_doc = inspect.getdoc(member)
            if not member_doc:
                continue
            sig = "" if isinstance(obj.__dict__[attr], property) else _signature(member)
            summary = " ".join(member_doc.split("\n\n")[0].split())
            lines += [f"- `{attr}{sig}`: {summary}"]
        lines.append("")
    return lines


def render() -> str:
    lines = [
        "# meshfit API reference",
        "",
        "Generated from the docstrings by `python docs/make_api.py`; do not edit by hand.",
        "The guide (docs/guide.md) explains how the pieces fit together.",
        "",
    ]
    for title, module, names in SECTIONS:
        lines += [f"## {title}", ""]
        for name in names:
            lines += _entry(module, name)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        current = open(OUT).read() if os.path.exists(OUT) else ""
        if current != text:
            print("docs/api.md is out of date: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
