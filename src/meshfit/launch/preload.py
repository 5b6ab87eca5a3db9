"""Imported by the warm-start server only (launch/warm.py), never by meshfit itself: it
imports the modules the launching process listed in MESHFIT_PRELOAD. A module that
fails to import is skipped: a worker that needs it imports it itself and gets the
error there, as a spawned worker would."""

import importlib
import os

for _name in filter(None, os.environ.get("MESHFIT_PRELOAD", "").split(",")):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S112 - see above
        continue
