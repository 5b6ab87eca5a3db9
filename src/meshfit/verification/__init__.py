"""The parts of mf.verify (verify.py): report.py (tolerances, the report), targets.py
(what is trained)."""
