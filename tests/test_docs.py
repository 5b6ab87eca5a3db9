"""The docs say what the code does: the API reference is regenerated from the
docstrings and must equal the committed docs/api.md."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_api_reference_is_current() -> None:
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "docs", "make_api.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr + "\nrun: python docs/make_api.py"
