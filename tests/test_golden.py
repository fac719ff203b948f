"""The simulator still computes what its golden fixtures recorded, bit for bit (tape and final
parameters). Regenerate with ``python tests/golden_runs.py`` only in a commit that says which
rule changed and why (see tests/golden_runs.py)."""

from __future__ import annotations

import json

import pytest
from golden_runs import HERE, RUNS, run


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_simulated_run_matches_its_golden_fixture(name):
    want = json.loads((HERE / f"{name}.json").read_text())
    got = run(name)
    assert got == want, {k: (want.get(k), got.get(k)) for k in want if got.get(k) != want.get(k)}
