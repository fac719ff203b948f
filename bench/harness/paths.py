"""Where things are, and the environment of every process a bench starts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""
SRC = ROOT / "src"
"""The package's source (benches run against the working tree, not an installed copy)."""
BENCH = ROOT / "bench"
CACHE = BENCH / "cache"
"""Each bench's cached cells live in ``CACHE / NAME``."""
RESULTS = ROOT / "docs" / "results"
"""Where a bench publishes ``NAME.md`` and ``NAME.json``."""

if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}
"""Every process a bench starts: one thread (the machine is shared and the measures are per core),
unbuffered output (its log is read while it runs), this tree's source first on the path."""


def sets(pairs: Iterable[str]) -> list[str]:
    """``["a=1", "b=2"]`` -> ``["--set", "a=1", "--set", "b=2"]`` (the CLI's config overrides)."""
    return [x for p in pairs for x in ("--set", p)]
