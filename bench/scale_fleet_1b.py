"""A syncer that keeps up at 1B (issue 33, item 3): fake learners with a 1B layout against 1, 2
and 4 syncer shards on emulated hosts, and the learner count one shard keeps up with at a 4 s step.

    python bench/scale_fleet_1b.py            # the cells (cached), then the report (about 15 min)
    python bench/scale_fleet_1b.py --report   # the report from cached cells only

Each cell is bench/scale_fleet.py's (``run_fleet_cell``: the real learner session, comm thread,
transport and wire, a sleep for a step, pre-built payloads) with the synthetic MLP at hidden
31,620 (1.0B parameters, P = H = 24: a 167 MB fp32 fragment, one round a step), int4 both ways
(what the 7B scale-equivalent run sends), a 4 s step, and every shard and fake-learner process on
an emulated host of its own (``--hosts``). Two cores cannot show shards scaling, so the measure
is CPU: per shard, CPU-seconds over the window against the rounds it closed and the answers it
merged, fitted as

    CPU per round = c_r + c_a x answers per round

over the cells of the same shard count (2 to 4 learners), and projected. With P = H one
fragment's round opens a step and every learner answers it; a shard of S owns 1/S of the
fragments, so per step it closes 1/S of a round and merges L/S answers, and needs

    (c_r + L c_a) / S   CPU-seconds per step, keeping up while that is <= u t

(t = 4 s, u = the cores a shard may use: 1). So L_max(S) = (u t S - c_r) / c_a. The fitted c_r
and c_a are the shard's own CPU (merge, outer step, encoding the down-link, the wire), measured
beside the fake learners on the same two cores; rounds that closed more than 100 ms after their
quorum-and-grace condition are counted per cell. Writes docs/results/scale_fleet_1b.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.paths import CACHE, RESULTS  # noqa: E402  (bench/harness, beside this script)
from harness.tables import facts, met, publish, table  # noqa: E402

HIDDEN_1B = 31_620
STEP_S = 4.0
PLAN = ((1, 2), (1, 3), (1, 4), (2, 2), (2, 4))
"""(shards, learners) of the measured cells: around what each shard count keeps up with here
(one shard at 1B merges an int4 answer in about 1.4 CPU-seconds: 4 learners overload it). Four
shards do not fit in 24 GiB at 1B: each builds the whole model before it keeps its share."""
SHARDS = (1, 2, 4)
SECONDS = 40.0
ENCODING = "int4"
CELLS = CACHE / "scale" / "fleet_1b"
USABLE_CORES = 1.0
"""What one shard may use: one core (the syncer's loop; its merge threads could use more)."""


def run(force: bool) -> list[dict[str, Any]]:
    from scale_fleet import run_fleet_cell

    out = []
    for shards, learners in PLAN:
        print(f"cell L{learners} S{shards}", flush=True)
        try:
            out.append(run_fleet_cell(learners, shards, ENCODING, SECONDS, CELLS, hidden=HIDDEN_1B, step_s=STEP_S,
                                      hosts=True, force=force))  # fmt: skip
        except (RuntimeError, ValueError) as e:
            print(f"  cell L{learners} S{shards}: {e}", flush=True)
    return out


def cached() -> list[dict[str, Any]]:
    out = []
    for p in sorted(CELLS.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("hidden") == HIDDEN_1B and d.get("hosts"):
            out.append(d)
    return out


def per_shard(cell: dict[str, Any]) -> dict[str, float] | None:
    """Mean over the cell's shards: CPU-seconds per round and answers merged per round."""
    window, shards = float(cell["window_s"]), int(cell["shards"])
    cpu = [x for x in cell.get("syncer_cpu") or [] if x is not None]
    if not cpu or not cell.get("rounds"):
        return None
    rounds_per_shard = cell["rounds"] / shards
    answers_per_round = cell["contributions_merged_per_s"] * window / cell["rounds"]
    cpu_s = sum(cpu) / len(cpu) * window
    return {"cpu_per_round_s": cpu_s / rounds_per_shard, "answers_per_round": answers_per_round,
            "rounds_per_shard": rounds_per_shard, "cpu_share": sum(cpu) / len(cpu)}  # fmt: skip


ROBUST_ANSWERS = 2.5
"""Rounds with at least 3 answers (MIN_ANSWERS) judge them against a coordinate-wise median:
cells whose rounds average more than this many answers are in that regime."""
PROFILE = {
    "command": "py-spy record -r 50 -d 40 --pid SYNCER (bench/scale_fleet.py --learners 2 --shards 1 --encodings "
    "int4 --hidden 31620 --step-s 4, loopback), samples by the syncer's functions",
    "per_answer_decode_s": 0.29,
    "per_round_close_s": 1.4,
    "close_parts_s": {"down-link int4 encoding with error feedback (Chain.advance)": 0.78,
                      "outer Nesterov step": 0.31, "the store's record of the new version": 0.40},
}  # fmt: skip
"""What the loop spends, measured once by hand with py-spy on 1 shard and 2 learners (no robust
centre at 2 answers): where a late round's time goes."""


def fit(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The CPU one answer costs a shard in the robust regime, as an upper bound (the round's own
    cost folded into its answers: c_r = 0), and the learners each shard count keeps up with."""
    robust = [(c, m) for c in cells if (m := per_shard(c)) is not None and m["answers_per_round"] > ROBUST_ANSWERS]
    plain = [(c, m) for c in cells if (m := per_shard(c)) is not None and m["answers_per_round"] <= ROBUST_ANSWERS]
    if not robust:
        return {}
    c_a = max(m["cpu_per_round_s"] / m["answers_per_round"] for _, m in robust)
    out: dict[str, Any] = {
        "c_a_s": c_a,
        "c_a_from": [f"L{c['learners']} S{c['shards']}" for c, _ in robust],
        "plain_per_answer_s": [m["cpu_per_round_s"] / m["answers_per_round"] for _, m in plain],
        "shards": {},
    }
    for s in SHARDS:
        out["shards"][str(s)] = {"learners_kept_up": USABLE_CORES * STEP_S * s / c_a,
                                 "at_7b": USABLE_CORES * STEP_S * s / (c_a * 7)}  # fmt: skip
    return out


def report(cells: list[dict[str, Any]], command: str) -> None:
    fits = fit(cells)
    rows = []
    for c in sorted(cells, key=lambda c: (c["shards"], c["learners"])):
        m = per_shard(c) or {}
        foreign = c.get("foreign_addresses") or {}
        per_step = m.get("cpu_per_round_s", float("nan")) / c["shards"]
        rows.append([
            c["shards"], c["learners"], c["rounds"], f"{c['contributions_merged_per_s']:.2f}",
            "/".join(f"{x:.2f}" for x in c["syncer_cpu"] if x is not None),
            f"{m.get('cpu_per_round_s', float('nan')):.2f}", f"{m.get('answers_per_round', float('nan')):.2f}",
            f"{per_step:.2f}", "yes" if per_step <= USABLE_CORES * STEP_S else "**no**",
            f"{c['rounds_late']} (p50 {c['late_s_p50']:+.2f} s)", "/".join(str(x) for x in c["syncer_hwm_mb"]),
            "yes" if foreign and not any(foreign.values()) else "no",
        ])  # fmt: skip
    late = sum(c["rounds_late"] for c in cells)
    params = cells[0]["params"] if cells else 0
    c_a = fits.get("c_a_s", float("nan"))
    proj = [[s, f"{USABLE_CORES:g} x {STEP_S:g} x {s} / {c_a:.2f} = **{f['learners_kept_up']:.1f}**",
             f"{f['at_7b']:.2f}"] for s, f in fits.get("shards", {}).items()]  # fmt: skip
    header = ["shards", "learners", "rounds", "merged/s", "CPU share per shard", "CPU s per round (shard)",
              "answers per round", "CPU s per step per shard", "keeps up (<= 4 s)", "late (> 100 ms)",
              "peak MB per shard", "bound to own address, keys on"]  # fmt: skip
    pr = PROFILE["close_parts_s"]
    lines = [
        "# A syncer at 1B: CPU per round and answer, and the learners one shard keeps up with",
        "",
        f"`{command}` on {facts(command)['date']} (2 cores shared by every shard and fake learner). Fake learners "
        f"(bench/scale_fleet.py) with a {params / 1e9:.2f}B layout, P = H = 24 (a 167 MB fp32 fragment, one round a "
        f"step), {ENCODING} both ways, a {STEP_S:g} s step, {SECONDS:g} s measured per cell after every learner is "
        "live; every shard and every fake-learner process on an emulated host of its own (network namespaces), CURVE "
        "keys on. Late: closed more than 100 ms after its quorum-and-grace condition (from the learners' send "
        "times). 4 shards did not fit: each shard builds the whole initial model before it keeps its share, and "
        "four 1B models with the fake learners beside them ran this 24 GiB machine out of memory (the cell was "
        "stopped with 0.5 GB left).",
        "",
        *table(header, rows),
        "",
        "## The projection",
        "",
        f"With P = H every learner answers one round a step, and a shard of S closes 1/S of the rounds: it needs "
        f"CPU per round / S each step and keeps up while that is at most u t ({USABLE_CORES:g} core x {STEP_S:g} s). "
        f"A round of 3 or more answers judges them against their coordinate-wise median (the robust merge), which "
        f"costs as much as the rest: its CPU per answer, the round's own cost folded in (an upper bound), is "
        f"c_a = {c_a:.2f} s (the largest over {', '.join(fits.get('c_a_from', []))}); rounds of 2 answers cost "
        + ", ".join(f"{x:.2f}" for x in fits.get("plain_per_answer_s", []))
        + " s per answer. Learners kept up with: L_max = u t S / c_a; at 7B a fragment is 7x larger, so c_a x 7.",
        "",
        *table(["S", "L_max at 1B", "L_max at 7B"], proj),
        "",
        "So at 1B on this machine's cores one shard keeps up with 2 learners and two with 4 (both measured: the "
        "table's CPU per step); a 7B run of 4 learners at 4 s steps needs about "
        f"{4 * c_a * 7 / (USABLE_CORES * STEP_S):.0f} shard cores.",
        "",
        f"Late rounds: {late} of {sum(c['rounds'] for c in cells)} ({met(late == 0)} against 0). Every round "
        "closes late at 1B, also where the shard's CPU keeps up (2 learners, 0.33-0.65 of a core): the syncer's loop "
        f"does a round's close in line, about {PROFILE['per_round_close_s']} s at 1B (down-link encoding with error "
        f"feedback {pr['down-link int4 encoding with error feedback (Chain.advance)']} s, outer step "
        f"{pr['outer Nesterov step']} s, the store's record {pr['the store' + chr(39) + 's record of the new version']}"
        f" s), and decodes each answer in about {PROFILE['per_answer_decode_s']} s; an answer that arrives during "
        "another fragment's close waits for it. Rounds close on time only once the close leaves the loop (a merge "
        "thread per shard) or the shard has a core per fragment it owns: not done here.",
        "",
        "## Detail",
        "",
        "```json",
        json.dumps({"fits": fits, "profile": PROFILE, "cells": cells}, indent=1),
        "```",
        "",
    ]
    publish(RESULTS, "scale_fleet_1b", {**facts(command), "fits": fits, "profile": PROFILE, "cells": cells},
            "\n".join(lines))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", action="store_true", help="the report from cached cells only")
    ap.add_argument("--force", action="store_true", help="measure cached cells again")
    a = ap.parse_args()
    if not a.report:
        from ddiloco.link.hosts import unavailable

        why = unavailable()
        if why is not None:
            print(f"scale_fleet_1b: {why}", file=sys.stderr)
            return 2
        run(a.force)
    cells = cached()
    if not cells:
        print("scale_fleet_1b: no cached cells", file=sys.stderr)
        return 1
    report(cells, "python bench/scale_fleet_1b.py" + (" --report" if a.report else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
