"""Scale-equivalent runs (issue 33): a small local run on emulated hosts that stands for a 7B run.

    python bench/scale_equiv.py            # both target links (about 10 minutes), then the report
    python bench/scale_equiv.py --quick    # a short 2-learner smoke run (bench/cache/scale_equiv/quick)
    python bench/scale_equiv.py --report   # the report from cached cells only

The target: 7B parameters (N_t = 28 GB in fp32), an inner step of 4 s, 4 learners, one learner
lost per 30 minutes (fleet-wide), each learner on a 1 Gbit/s link, or a 10 Gbit/s one. The local
run keeps the two ratios that decide the run's behaviour (ddiloco.goodput.target): transfer time
over step time and time between losses over step time. Its model is the scale workload's student
at 2M parameters (N_l = 8 MB), its step padded to 0.25 s (``runtime.step_sleep_s``: the compute of a
4 s accelerator step is a wait here, so the two cores stay free for what does scale, the syncer
and the links), so k = 16 target seconds per local second, each learner's link
R_l = R_t (N_l / N_t) k (4.6 Mbit/s for 1 Gbit/s) and a learner is lost every 112.5 s.

One cell is one ``ddiloco train`` run with ``chaos.hosts``: the syncer, each learner and the
evaluator on a network namespace of its own, each learner's rate from the kernel (tbf, both
ways), CURVE keys on, int4 both ways with error feedback (fp32 would need 1.17x the 1 Gbit/s
link: ``ddiloco goodput bandwidth``), everything else at its defaults. From the moment all four
learners have stepped, the losses come at F (i + 1/2): learner 1 is SIGKILLed and restarted on
its machine (its saved state kept), then learner 2 is SIGKILLed and replaced (its state deleted
before the launcher starts it again). The run goes on to 2 F after the first step (about 900
target steps); the launcher's restart delay is 2 s (32 target seconds) and a learner saves its
own state every 10 target-minutes (``runtime.local_state_s`` = 37.5 s).

Reported per target link, in target seconds beside local ones: goodput from the first step
(the launcher's accounting: learner-time on inner steps over learner-time allocated from each
learner's first step) and with the first join counted; what ``ddiloco goodput target`` predicts
for the target (its restart delay, the start-up measured at this run's start, and its default
bytes before a first step: 0.13 N for a restart, N for a replacement); the merged share; the
restart's and the replacement's bytes and times; the longest step gap of the learners never
lost; invariant violations; and every process's bound addresses (``ss`` in each namespace) and
command line (keys). Cells are cached in bench/cache/scale_equiv/. Writes
docs/results/scale_equiv.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cells import CellCache, cell_key, source_digest  # noqa: E402  (bench/harness, beside this script)
from harness.cluster import Launch  # noqa: E402
from harness.files import read_json_dict, read_jsonl, step_logs  # noqa: E402
from harness.paths import CACHE, RESULTS  # noqa: E402
from harness.sampling import descendants, read_proc, role_of  # noqa: E402
from harness.tables import facts, met, publish, table  # noqa: E402

CELLS = CACHE / "scale_equiv"
CACHE_VERSION = 1
RESTARTED, REPLACED = 1, 2
LOCAL_PARAMS = 2_000_000
LOCAL_STEP_S = 0.25
PAD_S = 0.23
"""runtime.step_sleep_s: the local step's wait (its compute, about 20 ms here, makes up the rest)."""
RESTART_DELAY_S = 2.0
SAVE_EVERY_TARGET_S = 600.0
"""A learner saves its own state every 10 target-minutes (runtime.local_state_s = this / k)."""
HEALTHY_MIN_STEPS = 300
"""The issue's floor: target-equivalent inner steps after the first step."""


class Plan:
    """One cell: a target link, the local run that stands for it, its timeline (local seconds)."""

    def __init__(self, name: str, link_bps: float, learners: int = 4, spans: float = 2.0) -> None:
        from scale import hidden_for, params_of  # bench/scale.py: the scale workload

        from ddiloco.goodput.target import Target, equivalent

        self.name, self.learners, self.spans = name, learners, spans
        self.target = Target(params=7e9, step_s=4.0, learners=learners, loss_every_s=1800.0, link_bps=link_bps)
        self.hidden = hidden_for(LOCAL_PARAMS)
        self.params = params_of(self.hidden)
        self.model_bytes = 4 * self.params
        self.eq = equivalent(self.target, self.params, LOCAL_STEP_S)
        self.rate_bps = self.eq.link_bps
        self.loss_every_s = self.eq.loss_every_s
        self.duration_s = 40.0 + spans * self.loss_every_s
        """runtime.duration_s: a generous first join, then ``spans`` F."""

    def config(self) -> dict[str, Any]:
        from scale import BATCH, DEPTH, TEACHER_HIDDEN

        rate = f"{self.rate_bps / 1e6:.4f}mbit"
        return {
            "run": {"num_learners": self.learners, "processed_tokens": 10**15, "seed": 0, "threads": 1},
            "workload": {
                "factory": "ddiloco.workloads.synthetic:make_workload",
                "batch_size": BATCH,
                "options": {"hidden": self.hidden, "depth": DEPTH, "teacher_hidden": TEACHER_HIDDEN},
            },
            "inner": {"warmup_frac": 0.0},
            "algo": {"up_encoding": "int4", "down_encoding": "int4", "error_feedback": True},
            "chaos": {
                "enabled": True,
                "hosts": True,
                "downtime_fraction": 0.0,
                "failures_per_learner": 0,
                "links": [f"{m}:{rate}" for m in range(self.learners)],
            },  # fmt: skip
            "runtime": {
                "duration_s": self.duration_s,
                "step_log": True,
                "status_interval_s": 0.5,
                "restart_delay_s": RESTART_DELAY_S,
                "step_sleep_s": PAD_S,
                "final_eval": False,
                "local_state_s": round(self.eq.to_local_s(SAVE_EVERY_TARGET_S), 2),
                "progress_interval_s": 30.0,
            },  # fmt: skip
        }

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "target": asdict(self.target), "local_params": self.params,
                "local_model_bytes": self.model_bytes, "local_step_s": LOCAL_STEP_S, "k": self.eq.k,
                "rate_bps": self.rate_bps, "loss_every_s": self.loss_every_s, "duration_s": self.duration_s,
                "learners": self.learners}  # fmt: skip


PLANS = {
    "7B-1gbit": lambda: Plan("7B-1gbit", 1e9),
    "7B-10gbit": lambda: Plan("7B-10gbit", 10e9),
    "quick": lambda: Plan("quick", 1e9, learners=2, spans=0.75),
}


# ----------------------------------------------------------------------------- the run


def namespace_of(pid: int) -> str | None:
    """The network namespace ``pid`` runs in (its ``ip netns`` name), from /proc/PID/net/ns's
    link against /run/netns/*."""
    try:
        ino = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    for p in Path("/run/netns").glob("*"):
        try:
            if p.stat().st_ino == ino:
                return p.name
        except OSError:
            continue
    return "(the machine's own)"


def bound_addresses() -> dict[str, list[str]]:
    """Every ddiloco namespace but the hubs: its TCP sockets' local addresses, by namespace name."""
    import subprocess

    from ddiloco.link.hosts import namespace_addresses

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split(" ")[0] for line in listed.splitlines()]
    out = {}
    for ns in (n for n in names if n.startswith("ddl") and not n.endswith("-hub")):
        try:
            out[ns] = sorted(namespace_addresses(ns))
        except RuntimeError:  # it went between the listing and the look (a run's end)
            continue
    return out


def addresses_of(ns: str) -> list[str]:
    import subprocess

    done = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True)
    return [c.split()[3].split("/")[0] for c in done.stdout.splitlines() if len(c.split()) >= 4]


def run_cell(plan: Plan, work: Path) -> dict[str, Any]:
    """One run; the raw figures (everything the report needs, nothing of the run folder)."""
    import tomli_w
    from events import Watch, event_figures, gap_figures

    cfg, run_dir = work / "scale_equiv.toml", work / "run"
    cfg.write_text(tomli_w.dumps(plan.config()))
    t0 = time.time()
    launcher = Launch([str(cfg), "--run-dir", str(run_dir)], work / "train.log")
    watch = Watch(launcher.pid, run_dir)
    roles: dict[str, dict[str, Any]] = {}
    sockets: dict[str, set[str]] = {}
    host_addr: dict[str, list[str]] = {}
    first_step: float | None = None
    losses: list[tuple[float, str]] = []
    deadline = t0 + plan.duration_s + 300
    last_ss = 0.0
    try:
        while launcher.running() and time.time() < deadline:
            watch.poll()
            for pid in descendants(launcher.pid):
                role = role_of(pid)
                if role is None or role == "launcher" or pid in roles.get(role, {}).get("pids", []):
                    continue
                ns = namespace_of(pid)
                argv = (read_proc(f"/proc/{pid}/cmdline") or "").split("\0")
                if not ns or not argv or argv[0] == "ip":  # (between ``ip netns exec`` and its exec)
                    continue
                rec = roles.setdefault(role, {"pids": [], "namespaces": [], "keys": [], "insecure": []})
                rec["pids"].append(pid)
                rec["namespaces"].append(ns)
                rec["keys"].append("--keys" in argv)
                rec["insecure"].append("--insecure" in argv)
            if time.time() - last_ss >= 5.0:
                last_ss = time.time()
                for ns, addrs in bound_addresses().items():
                    sockets.setdefault(ns, set()).update(addrs)
                    host_addr.setdefault(ns, addresses_of(ns))
            now = time.time()
            if first_step is None:
                if all((watch.status(f"learner-{m}").get("steps") or 0) >= 1 for m in range(plan.learners)):
                    first_step = now
                    print(f"  every learner stepped at {now - t0:.1f} s", flush=True)
            else:
                due = first_step + plan.loss_every_s * (len(losses) + 0.5)
                if len(losses) < 2 and now >= due:
                    m, what = (RESTARTED, "restart") if not losses else (REPLACED, "replace")
                    if m < plan.learners and watch.kill(m, what, drop_state=what == "replace"):
                        losses.append((now - first_step, what))
                    elif m >= plan.learners:
                        losses.append((now - first_step, "skipped"))
            time.sleep(0.5)
    finally:
        launcher.stop(signal.SIGTERM, 180)
        rc = launcher.wait()
    watch.poll()
    summary = read_json_dict(run_dir / "summary.json")
    accounting = read_json_dict(run_dir / "metrics" / "accounting.json")
    startup = [r for r in read_jsonl(run_dir / "metrics" / "startup.jsonl") if r.get("role") == "learner"]
    events = {what: event_figures(plan, watch, run_dir, m, what)  # type: ignore[arg-type]
              for m, what in ((RESTARTED, "restart"), (REPLACED, "replace")) if m < plan.learners}  # fmt: skip
    healthy = [m for m in range(plan.learners) if m not in (RESTARTED, REPLACED)]
    end = first_step + plan.spans * plan.loss_every_s if first_step else time.time()
    gaps = {str(m): gap_figures(run_dir, m, first_step or t0, end) for m in healthy}
    steps = step_logs(run_dir)
    durations = [d for m in healthy for _, d, _ in steps.get(m, [])]
    return {
        "launcher_rc": rc, "wall_s": time.time() - t0, "t0": t0, "first_step_at": first_step,
        "losses": losses, "summary": summary, "accounting": accounting, "startup": startup,
        "events": events, "healthy_gaps": gaps,
        "median_step_s": statistics.median(durations) if durations else None,
        "roles": roles, "sockets": {k: sorted(v) for k, v in sockets.items()}, "host_addresses": host_addr,
    }  # fmt: skip


# ----------------------------------------------------------------------------- figures


def figures(plan: Plan, raw: dict[str, Any]) -> dict[str, Any]:
    """The report's figures of one cell (target seconds beside local ones)."""
    from ddiloco.goodput.target import LossCosts, equivalent, predict

    acct, summary = raw["accounting"], raw["summary"]
    k_planned = plan.eq.k
    step = raw.get("median_step_s") or LOCAL_STEP_S
    k = plan.target.step_s / step  # realised: the measured step stands for the target's 4 s
    eq = equivalent(plan.target, plan.params, step)
    horizon, learners = float(acct.get("horizon_s") or 0.0), int(acct.get("learners") or plan.learners)
    starting, compute = float(acct.get("starting_s") or 0.0), float(acct.get("compute_s") or 0.0)
    alloc_from_first = learners * horizon - starting
    goodput_first = compute / alloc_from_first if alloc_from_first > 0 else None
    goodput_join = compute / (learners * horizon) if horizon > 0 else None
    firsts = sorted((r for r in raw["startup"] if isinstance(r.get("phases"), dict)), key=lambda r: r["incarnation"])
    first_inc = {}
    for r in firsts:
        first_inc.setdefault(r.get("id"), r)
    # start-up before it can fetch: the phases up to its registration ("join" begins there)
    startup_s = [float(r["phases"]["join"]) for r in first_inc.values() if "join" in r["phases"]]
    startup_local = statistics.median(startup_s) if startup_s else 0.0
    costs = LossCosts(restart_delay_s=RESTART_DELAY_S * k, startup_s=startup_local * k)
    # The prediction's span: the learner-time allocated from each learner's first step, per
    # learner (the losses are timed from the moment every learner had stepped: a little later).
    losses = [(t * k, what) for t, what in raw["losses"] if what in ("restart", "replace")]
    span_target = alloc_from_first / learners * k if alloc_from_first > 0 else 0.0
    pred = predict(plan.target, costs, span_target, losses) if span_target > 0 else None
    gaps = [g for g in raw["healthy_gaps"].values() if g.get("longest_gap_s")]
    longest = max(gaps, key=lambda g: g["longest_gap_s"]) if gaps else {}
    ev = {}
    for what, e in raw["events"].items():
        if not e.get("happened"):
            ev[what] = {"happened": False}
            continue
        moved = e["bytes"]["one_off_up"] + e["bytes"]["one_off_down"]
        first = e.get("first_step_s")
        ev[what] = {
            "happened": True,
            "moved_over_n": e["moved_over_n"], "down_over_n": e["down_over_n"], "up_over_n": e["up_over_n"],
            "moved_bytes_local": moved, "moved_bytes_target": e["moved_over_n"] * plan.target.model_bytes,
            "restart_delay_s": e.get("restart_delay_s"),
            "first_step_s": first, "first_step_target_s": first * k if first is not None else None,
            "first_merged_s": e.get("first_merged_s"),
            "first_merged_target_s": e["first_merged_s"] * k if e.get("first_merged_s") is not None else None,
            "state_loaded_s": e.get("state_loaded_s"),
            "state_loaded_target_s": e["state_loaded_s"] * k if e.get("state_loaded_s") is not None else None,
            "phases": e.get("phases"),
        }  # fmt: skip
    roles = raw["roles"]
    own = {ns: set(addrs) for ns, addrs in raw["host_addresses"].items()}
    foreign = {ns: sorted(set(a) - own.get(ns, set())) for ns, a in raw["sockets"].items()}
    bound_ok = bool(raw["sockets"]) and not any(foreign.values())
    on_hosts = all(ns.startswith("ddl") for r in roles.values() for ns in r["namespaces"])
    keys_ok = all(all(r["keys"]) and not any(r["insecure"]) for r in roles.values()) and bool(roles)
    violations = summary.get("invariant_violations")
    steps_after_first = span_target / plan.target.step_s if span_target else 0.0
    return {
        "k_planned": k_planned, "k": k, "median_step_s": step, "realised_link_bps": eq.link_bps,
        "horizon_s": horizon, "horizon_target_s": horizon * k, "target_steps_after_first": steps_after_first,
        "goodput_from_first_step": goodput_first, "goodput_with_first_join": goodput_join,
        "predicted": asdict(pred) if pred else None, "prediction_inputs": asdict(costs),
        "gap_points": (goodput_first - pred.goodput) * 100 if pred and goodput_first is not None else None,
        "merged_share": summary.get("merged_share"), "restart_latencies_s": acct.get("restart_latencies_s"),
        "events": ev, "longest_healthy_gap_s": longest.get("longest_gap_s"),
        "longest_healthy_gap_target_s": longest["longest_gap_s"] * k if longest.get("longest_gap_s") else None,
        "longest_healthy_gap_over_median": longest.get("longest_gap_over_median"),
        "invariant_violations": len(violations) if isinstance(violations, list) else None,
        "roles_on_own_hosts": on_hosts, "bound_to_own_address": bound_ok, "foreign_addresses": foreign,
        "keys_on": keys_ok, "startup_local_s": startup_local, "losses": raw["losses"],
        "launcher_rc": raw["launcher_rc"],
    }  # fmt: skip


# ----------------------------------------------------------------------------- report


def _f(x: Any, spec: str = ".1f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _ts(local: Any, k: float) -> str:
    """``T target s (L s)``."""
    return "-" if local is None else f"{local * k:,.0f} s ({local:.1f} s)"


def rows_of(name: str, plan: Plan, f: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """One cell's rows: (figure, value, target, met)."""
    k = f["k"]
    ev = f["events"]
    pred = (f["predicted"] or {}).get("goodput")
    gp = f["goodput_from_first_step"]
    out: list[tuple[str, str, str, bool | None]] = [
        ("local equivalent: k, link rate", f"{k:.1f}, {plan.rate_bps / 1e6:.2f} Mbit/s", "-", None),
        ("measured step (local)", f"{f['median_step_s'] * 1000:.0f} ms", "-", None),
        ("target steps after the first step", f"{f['target_steps_after_first']:,.0f}", ">= 300",
         f["target_steps_after_first"] >= HEALTHY_MIN_STEPS),
        ("goodput from the first step", _f(gp, ".1%"), ">= 90%" if plan.target.link_bps <= 1e9 else "-",
         (gp or 0) >= 0.90 if plan.target.link_bps <= 1e9 else None),
        ("... predicted by `ddiloco goodput target`", _f(pred, ".1%"), "within 3 points",
         f["gap_points"] is not None and abs(f["gap_points"]) <= 3),
        ("goodput with the first join counted", _f(f["goodput_with_first_join"], ".1%"), "-", None),
        ("merged share", _f(f["merged_share"], ".3f"), "-", None),
    ]  # fmt: skip
    for what, label in (("restart", "restart (its save kept)"), ("replace", "replacement (no state)")):
        e = ev.get(what, {})
        if not e.get("happened"):
            out.append((f"{label}", "did not happen", "-", None))
            continue
        at_7b = f"{e['moved_over_n']:.2f} N ({e['moved_bytes_target'] / 1e9:,.1f} GB at 7B)"
        out += [
            (f"{label}: bytes moved", at_7b, "-", None),
            (f"{label}: first step after its start", _ts(e.get("first_step_s"), k), "-", None),
            (f"{label}: first merged contribution", _ts(e.get("first_merged_s"), k), "-", None),
        ]
    if ev.get("replace", {}).get("happened"):
        out.append(("replacement: peer's optimizer state loaded", _ts(ev["replace"].get("state_loaded_s"), k), "-",
                    None))  # fmt: skip
    gap = f"{_ts(f['longest_healthy_gap_s'], k)} = {_f(f['longest_healthy_gap_over_median'], '.2f')}x its median"
    hosted = f["roles_on_own_hosts"] and f["bound_to_own_address"]
    out += [
        ("longest step gap of a learner never lost", gap, "-", None),
        ("invariant violations", _f(f["invariant_violations"], "d"), "0", f["invariant_violations"] == 0),
        ("every role on its own host, bound to its address", "yes" if hosted else "no", "yes", hosted),
        ("keys on (every role given --keys)", "yes" if f["keys_on"] else "no", "yes", f["keys_on"]),
    ]
    return out


def report(cells: dict[str, tuple[Plan, dict[str, Any]]], command: str) -> None:
    from ddiloco.goodput.target import LossCosts, Target, long_run_goodput

    cols = list(cells)
    figs = {n: figures(p, c["raw"]) for n, (p, c) in cells.items()}
    per = {n: rows_of(n, cells[n][0], figs[n]) for n in cols}
    labels = list(dict.fromkeys(r[0] for n in cols for r in per[n]))
    rows: list[list[Any]] = []
    for label in labels:
        got = {n: next((r for r in per[n] if r[0] == label), None) for n in cols}
        target = next((r[2] for r in got.values() if r and r[2] != "-"), "-")
        oks = [met(r[3]) if r else "-" for r in got.values()]
        rows.append([label, *[(r[1] if r else "-") for r in got.values()], target, " / ".join(oks)])

    first = cells[cols[0]][0]
    t = first.target
    long_run = {n: long_run_goodput(Target(7e9, 4.0, t.learners, 1800.0, cells[n][0].target.link_bps), LossCosts())
                for n in cols}  # fmt: skip
    lines = [
        "# Scale-equivalent runs: a 7B run on emulated hosts",
        "",
        f"`{command}` on {facts(command)['date']} (2 cores, other work beside it: timings are this machine's). "
        f"The target: {t.params / 1e9:g}B parameters (N_t = {t.model_bytes / 1e9:g} GB in fp32), an inner step of "
        f"{t.step_s:g} s, {t.learners} learners, one learner lost per {t.loss_every_s / 60:g} target-minutes, each "
        f"learner on its own link. The local run (bench/scale_equiv.py's docstring; the derivation is in "
        f"docs/runtime.md, \"Scale-equivalent runs\"): the scale workload's student at {first.params / 1e6:.2f}M "
        f"parameters, a step padded to {LOCAL_STEP_S} s, k = {first.eq.k:g} target seconds per local second as "
        f"planned (the table's k is the measured step's), the syncer, each learner and the evaluator on an emulated "
        f"host of its own (a network namespace, each learner's rate from the kernel's tbf both ways), CURVE keys, "
        f"int4 both ways with error feedback. Losses at F/2 and 3F/2 after every learner's first step: learner "
        f"{RESTARTED} restarted with its saved state, learner {REPLACED} replaced without it. Times are target "
        f"seconds (local seconds in brackets).",
        "",
        *table(["figure", *[f"{n}" for n in cols], "target", "met"], rows),
        "",
        "The prediction is `ddiloco goodput target` for the target with the run's losses at their times, its "
        "restart delay (2 s x k), the start-up its learners took at the run's start (x k) and its default bytes "
        "before a first step (0.13 N for a restart, N for a replacement); it is time accounting, like the "
        "launcher's. Over a long run at the default costs (30 s delay, 60 s start-up), `ddiloco goodput target` "
        "gives " + ", ".join(f"{n}: {v:.1%}" for n, v in long_run.items()) + ".",
        "",
        "Where the equivalence stops holding: a process's start-up (interpreter, imports, model) does not shrink "
        "with the model, so k times it overstates a 7B learner's (and understates its checkpoint read); the "
        "syncer's CPU per merge is tiny at 2M (at 1B it is docs/results/scale_fleet_1b.md's figure); memory "
        "does not scale at all.",
        "",
        "## Detail",
        "",
        "```json",
        json.dumps({n: {"plan": cells[n][0].describe(), "figures": figs[n]} for n in cols}, indent=1, default=str),
        "```",
        "",
    ]
    publish(RESULTS, "scale_equiv", {**facts(command), "cells": {n: {"plan": cells[n][0].describe(),
            "figures": figs[n], "raw": cells[n][1]["raw"]} for n in cols}}, "\n".join(lines), default=str)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 2-learner smoke run, cached apart")
    ap.add_argument("--report", action="store_true", help="the report from cached cells only")
    ap.add_argument("--keep", action="store_true", help="keep each cell's run folder")
    ap.add_argument("--out", type=Path, default=None, help="the quick run's report folder (default: none)")
    a = ap.parse_args()
    from ddiloco.link.hosts import unavailable

    why = unavailable()
    if why is not None and not a.report:
        print(f"scale_equiv: {why}", file=sys.stderr)
        return 2
    names = ["quick"] if a.quick else ["7B-1gbit", "7B-10gbit"]
    cache = CellCache(CELLS / ("quick" if a.quick else "cells"))
    code = source_digest(["service", "core", "protocol", "link", "training", "workloads"])
    cells: dict[str, tuple[Plan, dict[str, Any]]] = {}
    for name in names:
        plan = PLANS[name]()
        key = cell_key(name, {"v": CACHE_VERSION, "plan": plan.describe(), "config": plan.config(), "code": code})
        got = cache.get(key)
        if got is None and a.report:
            print(f"  {name}: not cached", flush=True)
            continue
        if got is None:
            print(f"{name}: running ({plan.duration_s:.0f} s of run time)", flush=True)
            work = Path(tempfile.mkdtemp(prefix=f"scale_equiv-{name}-"))
            try:
                got = {"raw": run_cell(plan, work), "key": key}
                cache.put(key, got)
            finally:
                if not a.keep:
                    shutil.rmtree(work, ignore_errors=True)
        cells[name] = (plan, got)
        f = figures(plan, got["raw"])
        print(f"  {name}: goodput {_f(f['goodput_from_first_step'], '.1%')} from the first step "
              f"(predicted {_f((f['predicted'] or {}).get('goodput'), '.1%')}), merged share "
              f"{_f(f['merged_share'], '.3f')}, violations {f['invariant_violations']}", flush=True)  # fmt: skip
    if cells and not a.quick:
        report(cells, "python bench/scale_equiv.py" + (" --report" if a.report else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
