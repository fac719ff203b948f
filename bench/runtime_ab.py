"""Two codes' runtime cost side by side: ``bench/runtime.py``'s paired on/off runs, alternating
between another checkout's source and this tree's, pair by pair, so the machine's drift falls on
both alike.

    git worktree add /tmp/old REV && cp -r bench/harness bench/runtime.py /tmp/old/bench/
    python bench/runtime_ab.py /tmp/old/src --rounds 2    # ~11 min: old, new, old, new

Each round is one pair (syncing off, then on) with the other source first on every process's
PYTHONPATH, then one with this tree's. Writes the rows to ``--out`` (JSON); issue 31's before/after
section of docs/results/runtime_pairs.md reads them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import runtime  # bench/runtime.py (puts this tree's src on sys.path through harness.paths)
from harness import paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other_src", help="the src/ folder of the other checkout (e.g. a worktree of the last release)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (other, this) pairs")
    ap.add_argument("--out", default="runtime_ab.json")
    args = ap.parse_args()
    if not (Path(args.other_src) / "ddiloco").is_dir() or args.rounds < 1:
        ap.error("other_src must hold a ddiloco package, and --rounds must be 1 or more")
    codes = {"other": str(Path(args.other_src).resolve()), "this": str(paths.SRC)}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for k in range(args.rounds):
            for code, src in codes.items():
                paths.ENV["PYTHONPATH"] = src  # every process the harness starts runs this source
                rep = runtime.pairs(Path(d) / f"{code}-{k}", 1, runtime.PAIR_PHASE_S, runtime.PAIR_WARMUP_S)
                rows.append({**rep["pairs"][0], "code": code, "src": src})
                Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
