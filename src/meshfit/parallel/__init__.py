"""One module per parallel form; compose.py applies a Plan in a fixed order."""

from meshfit.parallel.compose import apply_plan

__all__ = ["apply_plan"]
