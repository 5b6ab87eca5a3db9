"""`import meshfit` stays cheap: the modules most runs never use are imported where they
are used (BENCHMARKS.md, "Start-up"), so every worker process starts fast."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEAVY = ("torch.distributed.pipelining", "sympy", "meshfit.planner")


def test_import_meshfit_loads_no_pipelining_nor_planner() -> None:
    code = (
        "import sys, meshfit\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
        "meshfit.estimate, meshfit.plan_search, meshfit.planner.hardware\n"
        "print('meshfit.planner' in sys.modules, 'torch.distributed.pipelining' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    loaded, after = result.stdout.splitlines()
    assert loaded == "[]", f"import meshfit loaded {loaded}"
    # the planner arrives on first use, and still without the pipeline package
    assert after == "True False", after


def test_lazy_planner_names_are_listed() -> None:
    import meshfit as mf

    assert {"estimate", "plan_search"} <= set(mf.__all__) <= set(dir(mf))
    assert "planner" in dir(mf)
    from meshfit import estimate, plan_search
    from meshfit.planner import estimate as planner_estimate

    assert estimate is planner_estimate and callable(plan_search)
