"""The simulator still computes what its golden fixtures recorded: bit for bit (tape and final
parameters) on the machine that recorded them, and on any other the same decisions with floats
equal to within rounding. Regenerate with ``python tests/golden_runs.py`` only in a commit that
says which rule changed and why (see tests/golden_runs.py)."""

from __future__ import annotations

import json

import pytest
from golden_runs import HERE, RUNS, run

ROUNDING = 1e-5
"""Relative tolerance for floats on another machine: its kernels sum in another order. Measured
against this machine's fixtures with torch's AVX2 and plain kernels (ATEN_CPU_CAPABILITY), the
largest difference was 6.3e-7; a changed rule moves a merge weight, a norm or an outer step by
far more."""
EXACT = ("tape_structure_sha256", "rounds", "tokens_processed", "failures")
"""What no rounding may change: what the run decided, and its counts."""


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_simulated_run_matches_its_golden_fixture(name):
    want = json.loads((HERE / f"{name}.json").read_text())
    got = run(name)
    if got["machine"] == want["machine"]:  # the recording machine: every bit
        for key in ("tape_sha256", "params_sha256"):
            assert got[key] == want[key], (key, want["machine"])
    assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}
    for key in ("final_loss", "tokens_merged", "run_time_s"):
        assert got[key] == pytest.approx(want[key], rel=ROUNDING), key
    for key in ("tape_float_sums", "param_norms"):
        assert got[key].keys() == want[key].keys(), key
        for field, value in want[key].items():
            assert got[key][field] == pytest.approx(value, rel=ROUNDING, abs=1e-12), (key, field)
