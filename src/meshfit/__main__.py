"""`python -m meshfit ...`: the `meshfit` command, where its script is not on PATH."""

from meshfit.cli import main

raise SystemExit(main())
