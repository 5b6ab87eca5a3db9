"""The pieces of `mf.fit` (fit.py), by job: history, log, checks, data, evaluation,
resume, planning."""
