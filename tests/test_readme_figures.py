"""The README's test counts are the collected ones (tools/suite_figures.py writes them, with the
times it measured): a test added or removed without running it fails here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import suite_figures  # noqa: E402  (tools/, beside the tests)


def test_the_readme_counts_the_tests_there_are():
    fig = suite_figures.figures_in(suite_figures.README.read_text())
    assert fig, "the README has no test-figures block: run python tools/suite_figures.py --run"
    now = {"fast": suite_figures.collected(suite_figures.FAST), "slow": suite_figures.collected(suite_figures.SLOW)}
    said = {"fast": fig["fast"], "slow": fig["slow"]}
    assert said == now, "the README's test counts are stale: run python tools/suite_figures.py"
    assert suite_figures.paragraph(fig) in suite_figures.README.read_text()  # the words are the figures'
