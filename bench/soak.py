"""Soak benchmark (issue 8): a syncer and 4 learners over CURVE on loopback, under chaos and attack.

    python bench/soak.py --minutes 10                  # the report: attack run + its baseline (~22 min)
    python bench/soak.py --minutes 0.8 --no-baseline   # the CI variant (invariants only, ~1 min)
    python bench/soak.py --insider                     # the insider phase (bench/soak_insider.py, ~45 min)
    python bench/soak.py --flood                       # the flood phase (bench/soak_flood.py, ~10 min)

The attack run: the syncer, 3 honest learners (ids 0-2), an attacking learner (id 3, a process of
bench/soak_roles.py holding learner-3's valid key, answering with corrupted contributions in rotation:
NaN, 100x the current honest norm of the fragment, inflated counters, replays, wrong shapes;
from 20% of the run on) and an intruder (no key,
then a random unknown key: garbage, Registers, and ~100 fresh connections per second during
the second half). A seeded kill schedule SIGKILLs honest learners (restarted after 2 s) and the
syncer (restarted at once on the same run folder). The baseline is the same seed and the same
kill schedule without the attacker and the intruder (3 honest learners).

Invariants, checked every second and at the end: global parameters finite; versions per
fragment never decrease (fetches, status, tape) and strictly increase per produced round on
the tape; no version that was served is lost by a restore; no corrupted contribution merged
and every one accounted for by a rejection; the intruder never answered nor admitted; syncer
RSS growth; honest merge rate and eval loss against the baseline. Writes
docs/results/reliability.md and .json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cluster import Cluster  # noqa: E402  (bench/harness, beside this script)
from harness.paths import CACHE, RESULTS, sets  # noqa: E402
from harness.sampling import rss_kb  # noqa: E402
from harness.tables import facts, met, publish  # noqa: E402
from soak_setup import (  # noqa: E402  (the fleet's settings, shared with the insider phase)
    ATTACKER,
    ATTACKS,
    HONEST,
    LEARNER_RESTART_S,
    OVERSIZED_CUT,
    SETTINGS,
    STRANGER_ID,
    SYNCER_RESTART_S,
    load_cfg,
)

ROLES = Path(__file__).resolve().parent / "soak_roles.py"
"""The attacker's and the intruder's processes."""


def soak_cluster(run_dir: Path, keys: Path) -> Cluster:
    """A syncer and learners over CURVE with the soak's settings."""
    return Cluster(run_dir, sets(SETTINGS), keys=keys)


def start_helper(c: Cluster, role: str, until: float, extra: list[str]) -> None:
    """The attacker or the intruder (bench/soak_roles.py) against ``c``'s syncer until ``until``."""
    argv = [sys.executable, str(ROLES), f"--{role}", "--addr", c.addr, "--keys", str(c.keys)]
    argv += ["--run-dir", str(c.run_dir), "--until", f"{until:.3f}", *extra]
    c.start(role, argv)


def learner(c: Cluster, m: int) -> None:
    c.learner(m, threads=1)


def kill_schedule(seed: int, duration_s: float, mean_gap_s: float) -> list[tuple[float, str]]:
    """Poisson SIGKILLs from 15% of the run on; the syncer only in the first 60% (so its last
    incarnation spans at least 40% of the run: the RSS window). At least one learner kill and
    one syncer kill whatever the draw."""
    rng = random.Random(seed)
    out, t = [], 0.15 * duration_s
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t > 0.9 * duration_s:
            break
        target = "syncer" if rng.random() < 0.25 and t < 0.6 * duration_s else f"learner-{rng.choice(HONEST)}"
        out.append((round(t, 2), target))
    if not any(k.startswith("learner") for _, k in out):
        out.append((round(0.25 * duration_s, 2), f"learner-{rng.choice(HONEST)}"))
    if not any(k == "syncer" for _, k in out):
        out.append((round(0.45 * duration_s, 2), "syncer"))
    return sorted(out)


# -- one run -----------------------------------------------------------------------------------


def run_once(work: Path, duration_s: float, seed: int, schedule: list[tuple[float, str]], attack: bool) -> dict:
    import torch

    from ddiloco.core.tape import RoundRecord, parse_tape_record
    from ddiloco.service.base.keys import ClientKeys, make_keys
    from ddiloco.service.ops.evaluator import fetch_global

    run_dir = work / ("attack" if attack else "baseline")
    run_dir.mkdir(parents=True)
    keys = work / "keys"
    make_keys(keys, learners=4)
    observer = ClientKeys.load(keys, "observer")
    c = soak_cluster(run_dir, keys)
    tape = c.tape_reader()
    violations: list[dict] = []
    t0 = time.time()

    def violate(kind: str, detail: str) -> None:
        violations.append({"t": round(time.time() - t0, 2), "kind": kind, "detail": detail})
        print(f"VIOLATION {kind}: {detail}", flush=True)

    c.syncer()
    # The schedule's clock starts when the honest fleet trains, not when its processes are
    # spawned: on a busy machine start-up alone can take longer than a short run (bounded waits).
    deadline = time.time() + 300
    while not c.status("syncer-0") and time.time() < deadline:
        time.sleep(0.1)
    for m in HONEST:
        learner(c, m)
    deadline = time.time() + 300
    while not all(c.status(f"learner-{m}").get("steps", 0) > 0 for m in HONEST) and time.time() < deadline:
        time.sleep(0.2)
    t0 = c.t0_wall = time.time()
    end = t0 + duration_s
    if attack:
        start_helper(c, "attacker", end, ["--attack-from", f"{t0 + 0.2 * duration_s:.3f}"])
        start_helper(c, "intruder", end, ["--flood-from", f"{t0 + 0.5 * duration_s:.3f}"])
    pending = list(schedule)
    restarts: list[tuple[float, str]] = []
    faults: list[dict] = []
    served: dict[str, int] = {}  # highest version ever fetched or seen on the tape, per fragment
    seen_status: dict[str, int] = {}
    rss: list[tuple[float, int, int]] = []  # (t, syncer pid, kB)
    syncer_starts: list[float] = [0.0]
    learner_incs: dict[int, dict[int, int]] = {m: {} for m in HONEST}  # incarnation -> last steps seen
    live_ids: set[int] = set()
    fetches = failed_fetches = 0
    syncer_down_since: float | None = None
    check_restore = False

    def check_tape(new: list[dict]) -> None:
        """Note the versions the tape says were made (each was made durable before it was
        served); the tape's invariants are checked once, at the end, by ``check_run``."""
        for r in new:
            rd = parse_tape_record(r)
            if isinstance(rd, RoundRecord):
                served[str(rd.fragment)] = max(served.get(str(rd.fragment), 0), rd.version)

    while time.time() < end:
        now = time.time() - t0
        while pending and pending[0][0] <= now:
            _, target = pending.pop(0)
            if c.alive(target):
                c.kill(target)
                faults.append({"t": round(time.time() - t0, 2), "kind": "sigkill", "target": target})
                restarts.append((time.time() + (SYNCER_RESTART_S if target == "syncer" else LEARNER_RESTART_S), target))
                if target == "syncer":
                    syncer_down_since = time.time()
        for at, target in list(restarts):
            if time.time() >= at:
                restarts.remove((at, target))
                if target == "syncer":
                    c.syncer()
                    syncer_starts.append(time.time() - t0)
                    check_restore = True
                else:
                    learner(c, int(target.split("-")[1]))
        # the syncer's status: versions never decrease (a restored syncer continues), live ids, RSS
        st = c.status("syncer-0") if c.alive("syncer") else {}
        if st and st.get("pid") == c.procs["syncer"].pid:
            for p, v in st["versions"].items():
                if v < seen_status.get(p, 0):
                    violate("status_version_decreased", f"fragment {p}: {v} < {seen_status[p]}")
                seen_status[p] = max(seen_status.get(p, 0), v)
            live_ids.update(st.get("live", []))
            if STRANGER_ID in st.get("live", []):
                violate("intruder_admitted", f"live = {st['live']}")
            if check_restore:  # the restarted syncer serves at least every version served before
                check_restore = False
                for p, v in served.items():
                    if st["versions"].get(p, 0) < v:
                        violate("served_version_lost", f"fragment {p}: restored {st['versions'].get(p)} < served {v}")
        if c.alive("syncer"):
            kb = rss_kb(c.procs["syncer"].pid)
            if kb:
                rss.append((round(time.time() - t0, 2), c.procs["syncer"].pid, kb))
        for m in HONEST:
            ls = c.status(f"learner-{m}")
            if ls.get("incarnation") is not None:
                learner_incs[m][ls["incarnation"]] = max(learner_incs[m].get(ls["incarnation"], 0), ls.get("steps", 0))
        # the global model: finite, versions monotone
        if c.alive("syncer") and time.time() - c.spawned["syncer"][-1] > 3:
            states = fetch_global([c.addr], timeout_s=2.0, keys=observer)
            if states is None:
                failed_fetches += 1
            else:
                fetches += 1
                for s in states:
                    for name, tensor in s.tensors.items():
                        if not bool(torch.isfinite(tensor).all()):
                            violate("global_not_finite", f"piece {name} at versions {s.versions}")
                    for p, v in s.versions.items():
                        if v < served.get(p, 0) and syncer_down_since is None:
                            violate("fetched_version_decreased", f"fragment {p}: {v} < {served[p]}")
                        served[p] = max(served.get(p, 0), v)
                syncer_down_since = None
        check_tape(tape.poll())
        time.sleep(max(0.0, 1.0 - (time.time() - t0 - now)))
    wall = time.time() - t0
    c.stop(wait_for=("attacker", "intruder"))  # they stop on their own at the deadline and report
    check_tape(tape.poll())
    return finish(
        c,
        run_dir,
        tape.records,
        violations,
        faults,
        served,
        rss,
        syncer_starts,
        learner_incs,
        live_ids,
        wall,
        fetches,
        failed_fetches,
        attack,
    )


def finish(
    c,
    run_dir,
    records,
    violations,
    faults,
    served,
    rss,
    syncer_starts,
    learner_incs,
    live_ids,
    wall,
    fetches,
    failed_fetches,
    attack,
) -> dict:
    from safetensors.torch import load_file

    from ddiloco.core.syncer import Syncer
    from ddiloco.core.tape import RoundRecord, parse_tape_record
    from ddiloco.report.invariants import Restore, check_run
    from ddiloco.service.syncer.store import SyncerStore
    from ddiloco.training.evaluate import evaluate
    from ddiloco.training.layout import layout_for, synced_tensors
    from ddiloco.workloads.config import load_workload

    def violate(kind: str, detail: str) -> None:
        violations.append({"t": round(wall, 2), "kind": kind, "detail": detail})
        print(f"VIOLATION {kind}: {detail}", flush=True)

    cfg = load_cfg()
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    final = run_dir / "final" / "model.safetensors"
    eval_loss = float("nan")
    if final.exists():
        model.load_state_dict(load_file(str(final)))
        eval_loss = evaluate(wl, model, wl.eval_batches())
        if not all(bool(t.isfinite().all()) for t in model.state_dict().values() if t.is_floating_point()):
            violate("global_not_finite", "final model")
    else:
        violate("no_final_model", str(final))
    # restore from the durable state: nothing served may be missing
    fresh = wl.build_model(cfg.run.seed)
    layout = layout_for(fresh, wl, cfg.algo)
    owned = list(range(layout.num_fragments))
    core = Syncer(cfg.algo, layout.fragments, synced_tensors(fresh), layout.embedding_like, owned)
    store = SyncerStore(run_dir, 0, 1, fsync=False)
    try:
        found = store.restore(core.layout, core.owned)
        if found is not None:
            core.restore(found.fragments, found.syncer_meta)
    finally:
        store.close()
    restored = {str(p): core.fragments[p].version for p in owned}
    # the run's invariants, as every harness checks them: versions increase, nothing merged
    # twice, and the final restore has every version that was ever served
    final = Restore(wall, {int(p): v for p, v in restored.items()}, {int(p): v for p, v in served.items()})
    for v in check_run(records, restores=[final]):
        violate(v.kind, v.detail)
    positions = {m: core.data_position(m) for m in HONEST}
    # merges
    rounds = [r for r in records if r.get("event") == "round"]

    def t_of(r: dict) -> float:
        return r["closed_at"] + r.get("wall_offset", 0.0) - c.t0_wall

    honest_merges = [
        (t_of(r), e)
        for r in rounds
        if isinstance(rd := parse_tape_record(r), RoundRecord)
        for e in rd.took_part
        if e.learner in HONEST
    ]
    # rejections by reason and learner; notices of a quarantine are not answers
    rejections: list[dict] = []
    truncated = 0
    for r in records:
        if r.get("event") == "rejected":
            rejections.append(r)
        elif r.get("event") == "round":
            rejections += r["rejected"]
            truncated += r.get("rejected_total", 0) - len(r["rejected"])
    notices = [r for r in rejections if r["reason"] == "quarantined" and r["detail"].startswith("quarantined after")]
    answers = [r for r in rejections if r not in notices]
    by_reason: dict[str, dict[str, int]] = {}
    for r in answers:
        who = "attacker" if r["learner"] == ATTACKER else ("honest" if r["learner"] in HONEST else "other")
        by_reason.setdefault(r["reason"], {"attacker": 0, "honest": 0, "other": 0})[who] += 1
    out: dict[str, Any] = {
        "wall_s": wall,
        "eval_loss": eval_loss,
        "faults": faults,
        "syncer_starts_s": syncer_starts,
        "restarts_survived": {
            "syncer": sum(1 for f in faults if f["target"] == "syncer"),
            "learners": sum(1 for f in faults if f["target"] != "syncer"),
        },
        "served_versions": served,
        "restored_versions": restored,
        "fetches": fetches,
        "failed_fetches": failed_fetches,
        "rounds": len(rounds),
        "honest_merges": len(honest_merges),
        "honest_merge_times": [round(t, 2) for t, _ in honest_merges],
        "rejections_by_reason": by_reason,
        "rejections_unlisted": truncated,
        "quarantine_notices": len(notices),
        "live_ids_seen": sorted(live_ids),
    }
    st = c.status("syncer-0")
    out["syncer_counts"] = {k: st.get(k) for k in ("malformed", "unknown_sender", "impostor", "merges", "messages")}
    # RSS: within the last syncer incarnation, from minute 2 (or 20 s after its start, the later;
    # for a run too short for that: its first sample after 10 s) to the end
    last_pid = rss[-1][1] if rss else None
    last = [(t, kb) for t, pid, kb in rss if pid == last_pid]
    if last:
        start = last[0][0]
        ref_t = max(120.0, start + 20.0)
        if ref_t > last[-1][0] - 30:
            ref_t = start + 10.0
        ref = [kb for t, kb in last if t >= ref_t][:3]
        tail = [kb for t, kb in last][-3:]
        growth = (sum(tail) / len(tail)) / (sum(ref) / len(ref)) - 1 if ref else float("nan")
        window = last[-1][0] - ref_t
        out["rss"] = {
            "ref_t": ref_t,
            "window_s": window,
            "ref_kb": ref,
            "end_kb": tail,
            "growth": growth,
            "peak_kb": max(kb for _, _, kb in rss),
            "samples": len(rss),
        }
        if window >= 60 and growth > 0.10:
            violate("rss_growth", f"{growth:.1%} over {window:.0f} s")
    # samples: each honest learner's inner steps over all incarnations vs where the durable
    # state says its shard resumes (one batch per step): a killed incarnation's steps after its
    # last merged contribution are read again by the next one (duplicated); never skipped.
    out["samples"] = {
        str(m): {
            "incarnations": len(learner_incs[m]),
            "steps_trained": sum(learner_incs[m].values()),
            "durable_position": positions[m],
        }
        for m in HONEST
    }
    if attack:
        out["attack"] = attack_accounting(run_dir, rounds, answers, st, violate)
        out["intruder"] = intruder_accounting(run_dir, live_ids, violate)
    out["violations"] = violations
    return out


def attack_accounting(run_dir: Path, rounds: list[dict], answers: list[dict], st: dict, violate) -> dict:
    log = run_dir / "attacks.jsonl"
    sent = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    attacks = [a for a in sent if a["kind"] in ATTACKS]
    fillers = [a for a in sent if a["kind"] == "filler"]
    attack_ids = {(a["incarnation"], a["fragment"], a["seq"]): a["kind"] for a in attacks if a["kind"] != "replay"}
    merged3 = [
        (e["incarnation"], r["fragment"], e["seq"], e["weight"], e.get("scaled", 1.0))
        for r in rounds
        for e in r["merged"]
        if e["learner"] == ATTACKER
    ]
    seen: dict[tuple, int] = {}
    clipped: list[float] = []
    for inc, p, seq, w, scaled in merged3:
        ident = (inc, p, seq)
        if ident in attack_ids:
            kind = attack_ids[ident]
            if kind == "norm_100x" and scaled <= OVERSIZED_CUT:
                # The robust merge clips an oversized answer to robust_clip x the round's size
                # (honest restarts are oversized too) instead of refusing it: bounded, not merged whole.
                clipped.append(scaled)
                continue
            violate(f"attack_merged:{kind}", f"{kind} contribution {ident} merged with weight {w} at {scaled:.3g}x")
            continue
        seen[ident] = seen.get(ident, 0) + 1
        if seen[ident] > 1:
            violate("attack_merged:replay", f"contribution {ident} merged twice")
        if w > 0:
            violate("attacker_weight", f"a zero-step filler {ident} got weight {w}")
    by_kind = {k: sum(1 for a in attacks if a["kind"] == k) for k in ATTACKS}
    rejected = sum(1 for r in answers if r["learner"] == ATTACKER)
    # attacks sent while the syncer was down or had not re-registered us are dropped as
    # unknown_sender (counted per syncer incarnation in its status) or never arrive
    unaccounted = len(attacks) - rejected
    return {
        "sent_by_kind": by_kind,
        "attacks": len(attacks),
        "fillers": len(fillers),
        "fillers_merged_weight0": sum(1 for _ in merged3) - len(clipped),
        "norm_100x_merged_clipped": len(clipped),
        "norm_100x_largest_scale_merged": max(clipped, default=None),
        "rejections_of_attacker": rejected,
        "attacks_not_rejected": unaccounted,
        "registrations": sum(1 for a in sent if a["kind"] == "registered"),
    }


def intruder_accounting(run_dir: Path, live_ids: set[int], violate) -> dict:
    path = run_dir / "intruder.json"
    rep = json.loads(path.read_text()) if path.exists() else {}
    if not rep:
        violate("intruder_missing", "the intruder wrote no report")
    if rep.get("replies", 0):
        violate("intruder_answered", f"{rep['replies']} replies to the keyless/unknown-key client")
    return rep


# -- the report ------------------------------------------------------------------------------------


def merge_rate(times: list[float], t0: float, t1: float) -> float:
    return sum(1 for t in times if t0 <= t < t1) / max(1e-9, (t1 - t0)) * 60.0


def compare(rep: dict, duration_s: float) -> None:
    """Honest merge rate and eval loss against the baseline (violations when out of bounds)."""
    a, b = rep["attack"], rep.get("baseline")
    warm = 0.1 * duration_s
    rate_a = merge_rate(a["honest_merge_times"], warm, duration_s)
    flood_a = merge_rate(a["honest_merge_times"], 0.5 * duration_s, duration_s)
    rep["merge_rate_per_min"] = {"attack": rate_a, "attack_flood_window": flood_a}
    if b is None:
        return
    rate_b = merge_rate(b["honest_merge_times"], warm, duration_s)
    flood_b = merge_rate(b["honest_merge_times"], 0.5 * duration_s, duration_s)
    rep["merge_rate_per_min"].update({"baseline": rate_b, "baseline_flood_window": flood_b})
    rep["merge_rate_ratio"] = rate_a / rate_b if rate_b else float("nan")
    rep["flood_merge_rate_ratio"] = flood_a / flood_b if flood_b else float("nan")
    rep["eval_loss_ratio"] = a["eval_loss"] / b["eval_loss"] if b["eval_loss"] else float("nan")
    checks = [
        ("merge_rate", abs(rep["merge_rate_ratio"] - 1) <= 0.20, f"ratio {rep['merge_rate_ratio']:.3f}"),
        (
            "flood_merge_rate",
            abs(rep["flood_merge_rate_ratio"] - 1) <= 0.10,
            f"ratio {rep['flood_merge_rate_ratio']:.3f}",
        ),
        ("eval_loss", abs(rep["eval_loss_ratio"] - 1) <= 0.03, f"ratio {rep['eval_loss_ratio']:.4f}"),
    ]
    for kind, ok, detail in checks:
        if not ok:
            a["violations"].append({"t": duration_s, "kind": kind, "detail": detail})


def to_markdown(rep: dict) -> str:
    a, b = rep["attack"], rep.get("baseline")
    at = a.get("attack", {})
    intr = a.get("intruder", {})
    L = [
        "# Reliability soak (issue 8)",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, {rep['machine']['platform']}). "
        f"Attack run {a['wall_s']:.0f} s: a syncer, 3 honest learners, an attacking learner (id 3, valid key) and "
        "a keyless/unknown-key intruder, all on loopback with CURVE; synthetic workload "
        f"(`{' '.join(SETTINGS)}`). Kill schedule (seed {rep['seed']}): "
        + ", ".join(f"{t:.0f} s {k}" for t, k in rep["schedule"])
        + (
            "; the baseline ran the same seed and schedule with 3 honest learners only."
            if b
            else "; no baseline (CI variant)."
        ),
        "",
        "## Invariants",
        "",
        "| invariant | measured | target | met |",
        "|---|---|---|---|",
    ]
    kinds = {}
    for v in a["violations"]:
        kinds[v["kind"]] = kinds.get(v["kind"], 0) + 1

    def row(name: str, measured: str, target: str, ok: bool | None) -> None:
        L.append(f"| {name} | {measured} | {target} | {met(ok)} |")

    row("invariant violations (all kinds)", str(len(a["violations"])), "0", not a["violations"])
    row(
        "global parameters finite (every fetch and the final model)",
        f"{a['fetches']} fetches, {kinds.get('global_not_finite', 0)} non-finite",
        "0",
        "global_not_finite" not in kinds,
    )
    vkinds = ("version_order", "merged_twice", "status_version_decreased", "fetched_version_decreased")
    row(
        "versions per fragment strictly increasing across restarts, nothing merged twice (tape, status, fetches)",
        f"{sum(kinds.get(k, 0) for k in vkinds)} violations",
        "0",
        not any(k in kinds for k in vkinds),
    )
    row(
        "no served version lost by a restore (after each syncer restart and at the end)",
        f"served {a['served_versions']}, restored {a['restored_versions']}",
        "restored >= served",
        "served_version_lost" not in kinds,
    )
    if at:
        merged = {k: n for k, n in kinds.items() if k.startswith("attack_merged") or k == "attacker_weight"}
        row("corrupted contributions merged", f"{sum(merged.values())} {json.dumps(merged)}", "0", not merged)
        largest = at.get("norm_100x_largest_scale_merged")
        row(
            "100x-norm contributions merged only clipped (the robust merge's size bound, as for honest restarts)",
            f"{at.get('norm_100x_merged_clipped', 0)}"
            + (f", each cut to at most {largest:.3f}x its size" if largest is not None else ""),
            f"cut to <= {OVERSIZED_CUT}x",
            None,
        )
        row(
            "corrupted contributions rejected (tape) / sent",
            f"{at['rejections_of_attacker']} / {at['attacks']} ({at['attacks_not_rejected']} not on the tape: sent "
            "while the syncer was down or had not re-registered the attacker; see unknown_sender)",
            "all",
            None,
        )
        row(
            "keyless / unknown-key client answered or admitted",
            f"{intr.get('replies', '?')} replies; live ids seen {a['live_ids_seen']}",
            "0; never id 7",
            "intruder_answered" not in kinds and "intruder_admitted" not in kinds,
        )
    r = a.get("rss", {})
    if r:
        row(
            "syncer RSS growth (last incarnation, from max(120 s, its start + 20 s) to the end)",
            f"{r['growth']:+.1%} over {r['window_s']:.0f} s ({sum(r['ref_kb']) / len(r['ref_kb']) / 1024:.0f} -> "
            f"{sum(r['end_kb']) / len(r['end_kb']) / 1024:.0f} MiB)",
            "<= 10% (checked when the window >= 60 s)",
            r["growth"] <= 0.10 if r["window_s"] >= 60 else None,
        )
    mr = rep.get("merge_rate_per_min", {})
    flood_rate = intr.get("flood_connections", 0) / max(1.0, intr.get("flood_s", 1.0))
    if b:
        row(
            "honest merge rate vs baseline (merged honest contributions/min after 10% warm-up)",
            f"{mr['attack']:.1f} vs {mr['baseline']:.1f} = {rep['merge_rate_ratio']:.3f}",
            "within 20%",
            abs(rep["merge_rate_ratio"] - 1) <= 0.2,
        )
        row(
            f"honest merge rate during the connection flood (~{flood_rate:.0f} "
            "unauthenticated connections/s, second half)",
            f"{mr['attack_flood_window']:.1f} vs {mr['baseline_flood_window']:.1f} = "
            f"{rep['flood_merge_rate_ratio']:.3f}",
            "within 10%",
            abs(rep["flood_merge_rate_ratio"] - 1) <= 0.1,
        )
        row(
            "final eval loss vs baseline",
            f"{a['eval_loss']:.5f} vs {b['eval_loss']:.5f} = {rep['eval_loss_ratio']:.4f}",
            "within 3%",
            abs(rep["eval_loss_ratio"] - 1) <= 0.03,
        )
    else:
        row("honest merge rate (no baseline)", f"{mr.get('attack', 0):.1f}/min", "reported", None)
        row("final eval loss (no baseline)", f"{a['eval_loss']:.5f}", "reported", None)
    L += ["", "## Faults and attacks by kind", "", "| kind | count |", "|---|---|"]
    L.append(f"| SIGKILL syncer (restarted on the same run folder) | {a['restarts_survived']['syncer']} |")
    n = a["restarts_survived"]["learners"]
    L.append(f"| SIGKILL honest learner (restarted after {LEARNER_RESTART_S:.0f} s) | {n} |")
    for k, n in at.get("sent_by_kind", {}).items():
        L.append(f"| attack: {k} | {n} |")
    if at:
        L.append(f"| attacker zero-step fillers (valid, weight 0; replayed later) | {at['fillers']} |")
    if intr:
        L.append(f"| intruder connections (no key or unknown key) | {intr['connections']} |")
        L.append(f"| intruder garbage messages / Registers | {intr['garbage']} / {intr['registers']} |")
    L += ["", "## Rejections by reason (tape)", "", "| reason | attacker | honest |", "|---|---|---|"]
    for reason, n in sorted(a["rejections_by_reason"].items()):
        L.append(f"| {reason} | {n['attacker']} | {n['honest']} |")
    L.append(f"| (quarantine notices, not answers) | {a['quarantine_notices']} | |")
    L.append(f"| (refused but not listed in a round record) | {a['rejections_unlisted']} | |")
    sc = a["syncer_counts"]
    L += ["", f"Syncer counters of its last incarnation: {json.dumps(sc)}.", ""]
    L += [
        "## Restarts survived and samples",
        "",
        "| learner | incarnations | inner steps trained | durable data position | re-read (duplicated) | skipped |",
        "|---|---|---|---|---|---|",
    ]
    for m, s in a["samples"].items():
        dup = max(0, s["steps_trained"] - s["durable_position"])
        skip = max(0, s["durable_position"] - s["steps_trained"])
        L.append(f"| {m} | {s['incarnations']} | {s['steps_trained']} | {s['durable_position']} | <= {dup} | {skip} |")
    L += [
        "",
        "Samples: one batch per inner step; `steps trained` sums the last step count seen in each incarnation's "
        "status file (polled every second, so up to ~1 s of steps before a kill are missed); the durable data "
        "position is where the syncer's durable state says the shard resumes. Steps a killed incarnation trained "
        "after its last merged contribution are read again by the next one: the `re-read` column bounds them. "
        "Skipped = the durable position ahead of the steps trained. CAVEAT: not yet a valid measure: the durable "
        "position exceeds the summed status steps even with no kill (status `steps` appears not to count from "
        "the resume position), so these two columns are not comparable yet; see the report.",
    ]
    if a["violations"]:
        L += ["", "## Violations", "", "| t (s) | kind | detail |", "|---|---|---|"]
        L += [f"| {v['t']:.0f} | {v['kind']} | {v['detail']} |" for v in a["violations"][:50]]
    L += ["", "## Fault timeline (attack run)", "", "| t (s) | fault | target |", "|---|---|---|"]
    L += [f"| {f['t']:.1f} | {f['kind']} | {f['target']} |" for f in a["faults"]]
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--kill-every-s", type=float, default=30.0, help="mean gap of the Poisson kill schedule")
    ap.add_argument("--no-baseline", action="store_true", help="the attack run only (CI)")
    ap.add_argument("--out", default=str(RESULTS), help="folder for reliability.md/.json")
    ap.add_argument("--work", help="work folder (default: a fresh temporary one)")
    ap.add_argument("--insider", action="store_true", help="the insider phase (bench/soak_insider.py): 6 arms")
    ap.add_argument("--insider-s", type=float, default=90.0, help="insider phase: seconds of training per run")
    ap.add_argument("--reps", type=int, default=3, help="insider phase: repetitions per arm")
    ap.add_argument("--insider-arms", default="", help="insider phase: only these arms (comma-separated; a look)")
    ap.add_argument("--flood", action="store_true", help="the flood phase (bench/soak_flood.py): 4 arms")
    ap.add_argument("--flood-s", type=float, default=45.0, help="flood phase: seconds of flood per run")
    args = ap.parse_args()
    if args.flood:
        import soak_flood

        reps = args.reps if "--reps" in sys.argv else 2
        cmd = f"python bench/soak.py --flood --flood-s {args.flood_s:g} --reps {reps}"
        work = Path(args.work) if args.work else CACHE / "flood"
        return soak_flood.run_phase(work, args.flood_s, reps, Path(args.out), cmd)
    if args.insider:
        import soak_insider

        cmd = f"python bench/soak.py --insider --insider-s {args.insider_s:g} --reps {args.reps}"
        work = Path(args.work) if args.work else CACHE / "insider"
        arms = tuple(a for a in args.insider_arms.split(",") if a) or soak_insider.ARMS
        unknown = [a for a in arms if a not in soak_insider.ARMS]
        if unknown or "baseline" not in arms:
            ap.error(f"--insider-arms takes arms of {soak_insider.ARMS}, baseline among them; got {arms}")
        return soak_insider.run_phase(work, args.insider_s, args.reps, Path(args.out), cmd, arms)
    started = time.time()
    duration = args.minutes * 60
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ddiloco-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    schedule = kill_schedule(args.seed, duration, min(args.kill_every_s, duration / 3))
    print(f"work {work}; schedule {schedule}", flush=True)
    rep: dict[str, Any] = {"seed": args.seed, "schedule": schedule, "settings": SETTINGS}
    rep["attack"] = run_once(work, duration, args.seed, schedule, attack=True)
    if not args.no_baseline:
        rep["baseline"] = run_once(work, duration, args.seed, schedule, attack=False)
    compare(rep, duration)
    cmd = f"python bench/soak.py --minutes {args.minutes:g}" + (" --no-baseline" if args.no_baseline else "")
    rep.update(facts(cmd, total_wall_s=time.time() - started, work_dir=str(work)))
    rep["violations"] = len(rep["attack"]["violations"])
    publish(Path(args.out), "reliability", rep, to_markdown(rep), default=str)
    return 1 if rep["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
