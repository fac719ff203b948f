"""The README's test figures, measured instead of typed: how many tests each set holds and how
long each took on this machine, written between the README's ``test-figures`` markers.

    python tools/suite_figures.py                 # the counts (pytest --collect-only), times kept
    python tools/suite_figures.py --run           # also run the fast and the slow set and time them
    python tools/suite_figures.py --run --busy 3  # and the fast set 3 times beside 2 CPU-bound processes

tests/test_readme_figures.py checks that the README's counts are the collected ones, so a test
added or removed without running this fails there. Times are only ever measured here: no test
asserts on speed. Stdlib only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- test-figures: tools/suite_figures.py writes this paragraph -->", "<!-- /test-figures -->"
FAST, SLOW = ["-m", "not slow"], ["-m", "slow"]
_COLLECTED = re.compile(r"(\d+)(?:/\d+)? tests? collected")


def collected(marks: list[str]) -> int:
    """How many tests ``pytest -m ...`` runs (``--collect-only``, no workers)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider", *marks],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    found = _COLLECTED.findall(out.stdout)
    if not found:
        raise RuntimeError(f"pytest --collect-only said no count:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return int(found[-1])


def timed(args: list[str]) -> float:
    """Seconds one ``python -m pytest -q ARGS`` took (it must pass)."""
    began = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=ROOT, check=True)
    return time.monotonic() - began


def busy_runs(times: int) -> list[float]:
    """The fast set ``times`` times beside two CPU-bound processes (as a busy machine has)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        return [timed([]) for _ in range(times)]
    finally:
        for b in burners:
            b.kill()
            b.wait()


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def paragraph(fig: dict) -> str:
    cores = os.cpu_count()
    if "fast_s" not in fig:
        return (
            f"The fast set holds {fig['fast']:,} tests, the slow set {fig['slow']:,} (times not measured yet: "
            "`python tools/suite_figures.py --run`)."
        )
    text = (
        f"Measured by `python tools/suite_figures.py --run` on {fig['date']} ({cores} cores): the fast set "
        f"({fig['fast']:,} tests, on two workers) took {minutes(fig['fast_s'])}, the slow set ({fig['slow']:,} tests, "
        f"one at a time) {minutes(fig['slow_s'])}."
    )
    if fig.get("busy_s"):
        spans = [minutes(t) for t in (min(fig["busy_s"]), max(fig["busy_s"]))]
        text += (
            f" Beside two CPU-bound processes the fast set took {spans[0]} to {spans[1]} "
            f"({len(fig['busy_s'])} runs, no failure)."
        )
    return text


def figures_in(readme: str) -> dict:
    """The figures the README's paragraph was written from (kept in a comment beside it)."""
    found = re.search(r"<!-- figures: (\{.*?\}) -->", readme)
    return json.loads(found.group(1)) if found else {}


def write(fig: dict) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README} has no {BEGIN} ... {END} block: add the markers where the figures go")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    block = f"{BEGIN}\n{paragraph(fig)}\n<!-- figures: {json.dumps(fig, sort_keys=True)} -->\n{END}"
    README.write_text(head + block + tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--run", action="store_true", help="run both sets and time them (an idle machine)")
    ap.add_argument("--busy", type=int, default=0, help="then the fast set this many times beside 2 burners")
    args = ap.parse_args()
    fig = figures_in(README.read_text())
    fig.update(fast=collected(FAST), slow=collected(SLOW))
    write(fig)  # the counts first: the README's own test checks them while the sets run
    if args.run:
        # (the busy runs, of the fast set, are kept unless --busy measures them again)
        fig.update(date=dt.date.today().isoformat(), fast_s=timed([]), slow_s=timed(["-m", "slow", "-n", "0"]))
    if args.busy:
        fig["busy_s"] = busy_runs(args.busy)
    write(fig)
    print(paragraph(fig))


if __name__ == "__main__":
    main()
