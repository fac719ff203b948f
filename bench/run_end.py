"""A run end nobody misses (issue 35, item 1), on real processes without the launcher.

    python bench/run_end.py                # both cells, ~6 min
    python bench/run_end.py --cells held   # one

Each cell: a ``ddiloco syncer``, two ``ddiloco learner`` processes (the synthetic workload), each
behind its own ``ddiloco link`` relay at 2 Mbit/s and 150 ms, no launcher to stop anyone. As the
fleet nears its token budget, learner 1's relay is held for 20 s (SIGSTOP of the relay: nothing
crosses, the connections stay), across the run's end.

- ``held``: the syncer's defaults (``runtime.end_linger_s`` 60 s). Then learners are started 1 s
  and 10 s after the end, and, once the syncer has left, a syncer is started again on the ended
  folder and a learner 60 s after the end: each must be told the run ended, in one line.
- ``gone``: the syncer lingers 2 s only (``runtime.end_linger_s=2``), so the held learner can
  never hear the end: it must stop by itself, ``runtime.give_up_spent_s`` (60 s) after its last
  word from the syncer, its own count having reached the budget.

Reported per learner: how it ended (exit code, its last line) and when, from the run's end and
from its last word from the syncer (its relay's release, for the held one). Results in
``docs/results/run_end.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.cluster import Cluster, free_port, wait_until  # noqa: E402  (bench/harness, beside this script)
from harness.files import read_jsonl  # noqa: E402
from harness.paths import CACHE, RESULTS, ROOT, sets  # noqa: E402
from harness.tables import facts, publish, table  # noqa: E402

BUDGET = 60_000
LEAD_S = 6.0  # the hold begins when the budget is this far at the fleet's rate (the end then follows in ~12 s:
# the held learner's progress no longer reaches the syncer)
HOLD_S = 20.0
LINK = "2mbit,150ms"
RUN = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "run.num_learners=2",
    f"run.processed_tokens={BUDGET}",
    "algo.sync_every=8",
    "runtime.step_sleep_s=0.05",
    "runtime.status_interval_s=0.2",
]


_seen: list[tuple[float, float]] = []


def near_end(c: Cluster) -> bool:
    """The fleet's budget is about ``LEAD_S`` away at its rate over the last 5 s (the syncer's count)."""
    now, processed = time.time(), float(c.status("syncer-0").get("processed_tokens", 0) or 0)
    _seen.append((now, processed))
    back = [p for t, p in _seen if t <= now - 5.0]
    if not back:
        return False
    rate = (processed - back[-1]) / 5.0
    return rate > 0 and (BUDGET - processed) / rate <= LEAD_S


def end_time(run_dir: Path) -> float | None:
    """The wall time the syncer recorded the run's end (metrics/run.jsonl's "end" is on the run's clock)."""
    from ddiloco.report.summary import run_started_at

    ends = [r for r in read_jsonl(run_dir / "metrics" / "run.jsonl") if r.get("what") == "end"]
    start = run_started_at(run_dir)
    return None if not ends or start is None else start + float(ends[0]["time"])


def last_line(log: Path) -> str:
    """How the learner said the run ended for it: its last line that says so (told by the syncer,
    or giving up), else its last WARNING/ERROR line, else its last line."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    told = [ln for ln in lines if "ended the run" in ln or "this learner stops" in ln]
    said = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln]
    text = (told or said or lines or [""])[-1]
    return text.split("]: ", 1)[-1]


class Exits:
    """When each process ended, seen by a thread that polls them every 20 ms (a wait on one
    would miss when the others ended)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.procs: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for p in list(self.procs):
                if p.pid not in self.at and p.poll() is not None:
                    self.at[p.pid] = time.time()

    def close(self) -> None:
        self._stop.set()


EXITS = Exits()


def watch(c: Cluster, name: str) -> None:
    EXITS.procs.append(c.procs[name])


def exit_of(c: Cluster, name: str, timeout: float) -> dict[str, Any]:
    """Wait for role ``name`` to end by itself (bounded); its code, when and its last line."""
    p = c.procs[name]
    watch(c, name)
    if not wait_until(lambda: p.pid in EXITS.at, timeout, every=0.05):
        return {"code": None, "exited_at": None, "line": "still running after the bound: stopped by the bench"}
    return {"code": p.returncode, "exited_at": EXITS.at[p.pid], "line": last_line(c.run_dir / f"{name}.log")}


def run_cell(cell: str, out: Path) -> dict[str, Any]:
    run_dir = out / cell
    run_dir.mkdir(parents=True)
    _seen.clear()
    extra = [*RUN, *(["runtime.end_linger_s=2"] if cell == "gone" else [])]
    c = Cluster(run_dir, sets(extra))
    port = int(c.addr.rsplit(":", 1)[1])
    relays = [free_port() for _ in range(2)]
    try:
        c.syncer()
        watch(c, "syncer")
        wait_until(lambda: c.status("syncer-0"), 60)
        for m, p in enumerate(relays):
            relay = ["link", "--listen", f"127.0.0.1:{p}", "--to", f"127.0.0.1:{port}", "--link", LINK]
            c.start(f"link-{m}", [sys.executable, "-m", "ddiloco", *relay])  # (no run settings: a relay takes none)
        for m, p in enumerate(relays):
            argv = c.learner_args(m)
            argv[argv.index("--syncer") + 1] = f"tcp://127.0.0.1:{p}"
            c.ddiloco(f"learner-{m}", *argv)
            watch(c, f"learner-{m}")
        if not wait_until(lambda: near_end(c), 300, every=0.2):
            raise RuntimeError(f"the fleet never came near its budget; see {run_dir}")
        held_at = time.time()
        c.pause("link-1")
        # The hold lifts HOLD_S after it began; meanwhile (the held cell) learners start 1 s and
        # 10 s after the end, as a supervisor would restart one that died then.
        released, end, started = 0.0, None, {}
        deadline = held_at + 300
        while time.time() < deadline and (not released or end is None or (cell == "held" and len(started) < 2)):
            now = time.time()
            if not released and now >= held_at + HOLD_S:
                c.resume("link-1")
                released = now
            end = end if end is not None else end_time(run_dir)
            for after in (1.0, 10.0) if cell == "held" and end is not None else ():
                name = f"late-{after:g}s"
                if name not in started and now >= end + after:
                    started[name] = round(now - end, 1)
                    c.ddiloco(name, *c.learner_args(0))  # the id of a learner that has left
                    watch(c, name)
            time.sleep(0.02)
        if end is None:
            raise RuntimeError(f"the run did not end; see {run_dir}")
        learners: dict[int, dict[str, Any]] = {}
        late: dict[str, Any] = {}
        if cell == "held":  # the late learners start meanwhile: learner 1 may still be held at 10 s
            learners[0] = exit_of(c, "learner-0", 180)
            late = late_learners(c, end, started, learners)
        else:
            learners = {m: exit_of(c, f"learner-{m}", 180) for m in (0, 1)}
            syncer = exit_of(c, "syncer", 120)
            left = syncer["exited_at"]
            late["syncer_left_after_end_s"] = None if left is None else round(left - end, 1)
    finally:
        c.stop()
    return {
        "cell": cell,
        "end_linger_s": 2.0 if cell == "gone" else 60.0,
        "hold": {"began_s": round(held_at - end, 1), "released_s": round(released - end, 1)},
        "learners": {
            str(m): {
                "code": r["code"],
                "after_end_s": None if r["exited_at"] is None else round(r["exited_at"] - end, 1),
                "after_release_s": None if r["exited_at"] is None or m != 1 else round(r["exited_at"] - released, 1),
                "line": r["line"],
            }
            for m, r in learners.items()
        },
        "late": late,
    }


def late_learners(
    c: Cluster, end: float, started: dict[str, float], learners: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """How the learners started 1 s and 10 s after the end (``started``: when) ended; then one
    started 60 s after the end against a syncer started again on the ended folder (the first
    having left by itself). Learner 1's own end is waited for in between (into ``learners``)."""
    got: dict[str, Any] = {}
    for name, at in started.items():
        r = exit_of(c, name, 120)
        got[name] = {"code": r["code"], "started_after_end_s": at, "line": r["line"]}
    learners[1] = exit_of(c, "learner-1", 180)
    left = exit_of(c, "syncer", 120)["exited_at"]  # it leaves after its linger
    got["syncer_left_after_end_s"] = None if left is None else round(left - end, 1)
    c.restart("syncer")
    wait_until(lambda: c.status("syncer-0").get("pid") == c.pid("syncer"), 60)
    time.sleep(max(0.0, end + 60.0 - time.time()))
    started = round(time.time() - end, 1)
    c.ddiloco("late-60s", *c.learner_args(0))
    r = exit_of(c, "late-60s", 120)
    got["late-60s"] = {"code": r["code"], "started_after_end_s": started, "line": r["line"], "syncer": "restarted"}
    return got


def markdown(cells: list[dict[str, Any]], report: dict[str, Any]) -> str:
    lines = [
        "# A run end nobody misses",
        "",
        f"`{report['command']}` on {report['date']}. Two `ddiloco learner` processes, no launcher, each behind "
        f"`ddiloco link` at {LINK}; learner 1's relay held {HOLD_S:g} s across the end (SIGSTOP of the relay). "
        "Times are seconds after the syncer recorded the run's end.",
        "",
    ]
    for cell in cells:
        lines += [f"## `{cell['cell']}`: runtime.end_linger_s = {cell['end_linger_s']:g} s", ""]
        lines.append(f"Hold from {cell['hold']['began_s']} s to {cell['hold']['released_s']} s.")
        if cell["cell"] == "gone":
            bound = cell["hold"]["began_s"] + 60.0
            lines.append(
                f"The held learner never hears the end: its bound is runtime.give_up_spent_s (60 s) after its last "
                f"word from the syncer (the hold's start, at most one heartbeat before): {bound:.1f} s after the end, "
                "then the time it takes to leave (its step under way, its status and local save)."
            )
        else:
            lines.append("Every learner hears the end from the syncer, the held one once its relay is released.")
        lines.append("")
        rows = [
            [m, r["code"], r["after_end_s"], "-" if r["after_release_s"] is None else r["after_release_s"], r["line"]]
            for m, r in cell["learners"].items()
        ]
        lines += table(["learner", "exit code", "stopped at (s)", "after the release (s)", "its last line"], rows)
        if len(cell["late"]) > 1:
            lines += ["", "Late learners:", ""]
            rows = [
                [name, r["started_after_end_s"], r.get("syncer", "lingering"), r["code"], r["line"]]
                for name, r in cell["late"].items()
                if isinstance(r, dict)
            ]
            lines += table(["learner", "started at (s)", "syncer", "exit code", "its line"], rows)
        lines += ["", f"The syncer left by itself {cell['late']['syncer_left_after_end_s']} s after the end.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--cells", default="held,gone", help="comma-separated: held, gone")
    ap.add_argument(
        "--refigure", action="store_true", help="read the learners' lines again from the last report's kept run folders"
    )
    args = ap.parse_args()
    if args.refigure:
        report = json.loads((RESULTS / "run_end.json").read_text())
        for cell in report["cells"]:
            folder = Path(report["folder"]) / cell["cell"]
            for m, r in cell["learners"].items():
                r["line"] = last_line(folder / f"learner-{m}.log")
            for name, r in cell["late"].items():
                if isinstance(r, dict):
                    r["line"] = last_line(folder / f"{name}.log")
        publish(RESULTS, "run_end", report, markdown(report["cells"], report))
        return
    out = CACHE / "run_end" / time.strftime("%Y%m%d-%H%M%S")
    cells = [run_cell(cell, out) for cell in args.cells.split(",")]
    report = {**facts("python bench/run_end.py" + ("" if args.cells == "held,gone" else f" --cells {args.cells}"))}
    report["cells"] = cells
    report["settings"] = RUN
    report["folder"] = str(out.relative_to(ROOT))
    publish(RESULTS, "run_end", report, markdown(cells, report))


if __name__ == "__main__":
    main()
