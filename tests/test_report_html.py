"""``ddiloco report``: one self-contained HTML page from run folders of format 2."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.report.html import render_report
from ddiloco.report.run_view import busy_increments, goodput_series, load_run
from ddiloco.report.tape import read_jsonl_cut as read_jsonl

FIGURES = ("eval-loss", "train-loss", "goodput", "participation", "staleness", "bytes-sent")
STARTED_AT = 1_760_000_000.0
MONO0 = 5_000.0
"""The syncer's monotonic clock at the run's start (real run): wall_offset = STARTED_AT - MONO0."""


def _jsonl(path: Path, records: list, garbled: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records]
    if garbled is not None:
        lines.insert(len(lines) // 2, garbled)
    path.write_text("\n".join(lines) + "\n")


def make_run(
    d: Path, real: bool = False, horizon: float = 60.0, learners: int = 3, fragments: int = 2, seed: int = 0
) -> Path:
    """A run folder of format 2 written by hand: a simulated one (virtual clock) or a real one
    (wall clock, tape times monotonic with wall_offset, partial, no accounting.json). Learner 1
    is killed at a third of the run and restarts (its counters reset), one merged entry per
    fragment has weight 0, some are admitted in grace, and a garbled line sits in each file."""
    d.mkdir(parents=True)
    by = "ddiloco train" if real else "ddiloco simulate"
    meta = {"format": 2, "created": "2025-10-09T10:00:00+00:00", "by": by}
    if real:
        meta["started_at"] = STARTED_AT
    (d / "run.json").write_text(json.dumps(meta))
    method = "decoupled" if not real else "streaming"
    (d / "config.toml").write_text(f'[run]\nmethod = "{method}"\nnum_learners = {learners}\n')
    kill, back = horizon / 3 + 7 * seed, horizon / 3 + 7 * seed + 6.0
    slow = 0.7 - 0.2 * seed  # learner 2 is a 2x straggler after slow x horizon
    faults = [
        {"event": "fault", "time": kill, "kind": "sigkill", "target": "learner 1"},
        {"event": "fault", "time": back, "kind": "restart", "target": "learner 1"},
        {"event": "fault", "time": horizon * slow, "kind": "straggler", "target": "learner 2"},
    ]
    _jsonl(d / "metrics" / "faults.jsonl", faults, garbled='{"event": "fault", "ti')
    recs = []
    state = {m: {"busy": 0.0, "bytes": 0, "tokens": 0, "steps": 0} for m in range(learners)}
    t = 2.0
    while t <= horizon + 1e-9:
        for m in range(learners):
            s = state[m]
            down = m == 1 and kill <= t < back
            if m == 1 and back <= t < back + 2.0:
                s.update(busy=0.0, bytes=0, tokens=0, steps=0)  # a new incarnation starts from 0
            if not down:
                rate = 0.5 if m == 2 and t > horizon * slow else 1.0
                s["busy"] += 2.0 * 0.9 * rate
                s["steps"] += int(4 * rate)
                s["tokens"] += int(4096 * rate)
                s["bytes"] += 150_000 + 20_000 * m * (1 + seed)
            loss = 3.0 * math.exp(-t / (horizon * (1 + 0.3 * seed))) + 0.05 * m + 0.1 * seed
            recs.append(
                {
                    "event": "learner",
                    "time": t,
                    "learner": m,
                    "state": "down" if down else "up",
                    "steps": s["steps"],
                    "tokens": s["tokens"],
                    "busy_s": round(s["busy"], 3),
                    "loss": None if down else loss,
                    "bytes_sent": s["bytes"],
                }  # fmt: skip
            )
        t += 2.0
    _jsonl(d / "metrics" / "learners.jsonl", recs, garbled="\x00\xff not json {")
    evals = [
        {
            "event": "eval",
            "time": float(t),
            "tokens": int(t * 4096),
            "merged_tokens": int(t * 3000),
            "loss": 3.2 * math.exp(-t / (horizon * (1 + 0.3 * seed))) + 0.1 * seed,
            "final": t >= horizon,
        }  # fmt: skip
        for t in range(0, int(horizon) + 1, 10)
    ]
    _jsonl(d / "metrics" / "eval.jsonl", evals, garbled='{"event": "eval", "time": 3, "loss": ')
    _jsonl(d / "metrics" / "run.jsonl", [{"event": "run", "time": 0.0, "what": "start", "reason": ""}])
    if not real:
        (d / "metrics" / "accounting.json").write_text(
            json.dumps(
                {
                    "horizon_s": horizon,
                    "learners": learners,
                    "compute_s": 150.0,
                    "blocked_s": 3.0,
                    "down_s": 6.0,
                    "restarting_s": 2.0,
                }
            )  # fmt: skip
        )
    tape, version, rid = [], [0] * fragments, 0
    t = 1.0
    while t + 3.0 <= horizon:
        for p in range(fragments):
            opened, closed = t + p * 0.5, t + p * 0.5 + 3.0
            grace = 1.0 + 0.5 * ((rid + seed) % 4) if rid % 3 == 0 else 0.0
            merged = []
            for m in range(learners):
                if m == 1 and kill <= closed < back + 2.0:
                    continue  # down: no answer
                weight = 0.0 if (m == 2 and rid % 7 == 3) else 4096.0 * (1.0 + 0.2 * m)
                merged.append(
                    {
                        "learner": m,
                        "incarnation": 1 if (m == 1 and closed >= back) else 0,
                        "seq": rid,
                        "base_version": max(0, version[p] - m % 2),
                        "staleness": (m * (1 + seed) + rid) % (3 + seed),
                        "weight": weight,
                        "tokens": 4096,
                        "steps": 4,
                        "in_grace": bool(grace) and m == learners - 1,
                        "clipped": False,
                        "norm": 0.5,
                    }  # fmt: skip
                )
            version[p] += 1
            rec = {"event": "round", "fragment": p, "round": rid, "opened_at": opened, "closed_at": closed,
                   "version": version[p], "quorum": 2, "grace_s": grace,
                   "close_reason": "grace_over" if grace else "all_answered", "merged": merged, "rejected": [],
                   "rejected_total": 0}  # fmt: skip
            rid += 1
            tape.append(rec)
        t += 4.0
    tape.append({"event": "late", "learner": 1, "fragment": 0, "time": horizon - 1.0})
    tape.append({"event": "rejected", "learner": 9, "fragment": 0, "reason": "unknown_learner", "detail": "",
                 "time": 5.0})  # fmt: skip
    if real:  # the syncer's monotonic clock, with wall minus monotonic alongside
        for r in tape:
            for k in ("opened_at", "closed_at", "time"):
                if k in r:
                    r[k] += MONO0
            r["wall_offset"] = STARTED_AT - MONO0
    _jsonl(d / "tape.jsonl", tape, garbled='{"event": "round", "fragm')
    summary = {
        "method": method, "clock": "wall" if real else "virtual", "loss_unit": "nats/byte",
        "eval_loss": evals[-1]["loss"], "tokens_processed": 700_000, "tokens_merged": 600_000 - 40_000 * seed,
        "merged_share": (600_000 - 40_000 * seed) / 700_000, "goodput": 0.86 - 0.02 * seed, "failures": 1,
        "num_fragments": fragments,
        "rounds_per_fragment": rid / fragments, "learners_per_merge": 2.9 - 0.1 * seed, "virtual_time_s": horizon,
    }  # fmt: skip
    if real:
        summary.update(partial=True, warnings=["learner 2 was slow <b>2x</b> for the last third"])
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def figures(page: str) -> dict[str, str]:
    """Figure id -> its HTML."""
    return dict(re.findall(r'<figure id="([^"]+)">(.*?)</figure>', page, re.S))


def pngs(fragment: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', fragment)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("runs")
    return make_run(base / "sim-decoupled"), make_run(base / "real-streaming", real=True, seed=1)


@pytest.mark.parametrize("which", [0, 1], ids=["simulated", "real"])
def test_one_run_has_every_figure_as_an_inline_png(runs, which):
    out = render_report([runs[which]], runs[which] / "report.html")
    page = out.read_text()
    figs = figures(page)
    assert set(figs) == set(FIGURES)
    for fid in FIGURES:
        images = pngs(figs[fid])
        assert len(images) == 1, fid
        assert images[0][:8] == b"\x89PNG\r\n\x1a\n" and len(images[0]) > 5000, fid
        assert "No data" not in figs[fid], fid
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained, inert
    assert "docs/operations.md#terms" in page


def test_two_runs_are_overlaid_with_one_legend_entry_each(runs, tmp_path):
    out = render_report(list(runs), tmp_path / "both.html")
    page = out.read_text()
    figs = figures(page)
    for fid in ("eval-loss", "goodput", "staleness"):  # shared axes
        assert len(pngs(figs[fid])) == 1, fid
    for fid in ("train-loss", "participation", "bytes-sent"):  # one per run
        assert len(pngs(figs[fid])) == 2, fid
    assert "sim-decoupled (decoupled)" in page and "real-streaming (streaming)" in page
    assert "virtual" in page and "wall" in page


def test_missing_data_says_so_in_a_line(tmp_path):
    d = tmp_path / "hand-started"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"format": 2, "by": "ddiloco syncer"}))
    page = render_report([d], None).read_text()
    assert (d / "report.html").exists()
    figs = figures(page)
    assert set(figs) == set(FIGURES)
    for fid in FIGURES:
        assert not pngs(figs[fid]) and "No data" in figs[fid], fid
    assert "no readable summary.json" in page


def test_an_interrupted_run_without_evals_keeps_its_other_figures(runs, tmp_path):
    d = make_run(tmp_path / "interrupted", real=True)
    (d / "metrics" / "eval.jsonl").unlink()
    figs = figures(render_report([d], tmp_path / "r.html").read_text())
    assert "No data" in figs["eval-loss"] and not pngs(figs["eval-loss"])
    assert len(pngs(figs["goodput"])) == 1


def test_garbled_torn_and_overlong_lines_are_skipped(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": 2, "b"\n\xff\xfe\n[1, 2]\n' + b'{"big": "' + b"x" * 100 + b'"}\n{"a": 3}')
    records, cut = read_jsonl(p)
    assert [r.get("a") for r in records] == [1, None, 3] and not cut
    assert read_jsonl(p, limit=2) == ([{"a": 1}, {"big": "x" * 100}], True)
    assert read_jsonl(tmp_path / "missing.jsonl") == ([], False)


def test_overlong_line_is_skipped_without_reading_it_whole(tmp_path, monkeypatch):
    import ddiloco.report.tape as tape

    monkeypatch.setattr(tape, "MAX_LINE_BYTES", 64)
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n{"big": "' + b"x" * 1000 + b'"}\n{"a": 2}\n')
    assert read_jsonl(p)[0] == [{"a": 1}, {"a": 2}]


def test_a_counter_reset_is_a_restart_not_negative_work():
    recs = [{"time": t, "busy_s": b} for t, b in [(2, 2.0), (4, 4.0), (6, 1.0), (8, 3.0)]]
    pieces = busy_increments(recs)
    assert all(amount > 0 for _, _, amount in pieces)
    assert sum(amount for _, _, amount in pieces) == pytest.approx(4.0 + 1.0 + 2.0)
    assert pieces[2] == (5.0, 6.0, 1.0)  # the new incarnation's second, at the end of the gap


def test_goodput_matches_the_busy_share(runs):
    run = load_run(runs[0])
    edges, values, mean = goodput_series(run)
    assert edges[0] == 0 and len(values) == len(edges) - 1
    assert all(0 <= v <= 1.0 + 1e-9 for v in values)
    # 0.9 busy when up; learner 1 is down 6 s, learner 2 at half speed for the last 30%
    expected = 0.9 * (3 * 60 - 6 - 0.3 * 60 * 0.5) / (3 * 60)
    assert mean == pytest.approx(expected, abs=0.03)


def test_real_tape_times_are_seconds_since_the_start(runs):
    sim, real = load_run(runs[0]), load_run(runs[1])
    first = [r for r in real.tape if r.get("event") == "round"][0]
    assert first["opened_at"] == pytest.approx(1.0) and first["closed_at"] == pytest.approx(4.0)
    assert [r["closed_at"] for r in real.tape if "closed_at" in r] == pytest.approx(
        [r["closed_at"] for r in sim.tape if "closed_at" in r]
    )
    assert len(real.learners) == 90 and len(real.faults) == 3  # the garbled lines are gone


def test_strings_are_escaped(tmp_path):
    d = make_run(tmp_path / "<script>x</script>", real=True)
    page = render_report([d], tmp_path / "r.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "&lt;b&gt;2x&lt;/b&gt;" in page  # the warning, as text


@pytest.mark.slow  # python -m ddiloco as a process
def test_cli_writes_the_report(runs, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "report", str(runs[0]), str(runs[1]), "-o", str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.html").stat().st_size > 10_000
    assert "r.html" in proc.stdout


def test_the_summary_shows_the_links_traffic_and_a_table_per_learner(tmp_path):
    d = make_run(tmp_path / "traffic")
    summary = json.loads((d / "summary.json").read_text())
    summary["traffic"] = {
        "params": 1000, "learners": 2, "steps": 20, "up_bytes_per_step": 150.0, "down_bytes_per_step": 100.0,
        "one_off_up_bytes": 700, "one_off_down_bytes": 9000, "dp_bytes_per_step": 4000.0,
        "dp_ratio_up": 4000 / 150, "dp_ratio_down": 40.0,
        "by_learner": {"1": {"steps": 10, "up_bytes_per_step": 160.0, "down_bytes_per_step": 100.0,
                             "one_off_up_bytes": 350, "one_off_down_bytes": 4500},
                       "unattributed": {"steps": 0, "up_bytes_per_step": None, "down_bytes_per_step": None,
                                        "one_off_up_bytes": 0, "one_off_down_bytes": 40}},
    }  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    page = render_report([d], d / "report.html").read_text()
    assert '<th>bytes / learner / inner step up (steady)</th><td class="v">150</td>' in page
    assert '<th>one-off bytes up / down</th><td class="v">700 / 9,000</td>' in page
    assert '<th>x fewer bytes than data-parallel up / down</th><td class="v">26.7 / 40.0</td>' in page
    assert "<tr><th>1</th>" + "".join(f'<td class="v">{c}</td>' for c in ("10", "160", "100", "350", "4,500")) in page
    assert "<tr><th>unattributed</th>" in page
    # a run that counted no traffic shows dashes, and no table
    del summary["traffic"]
    (d / "summary.json").write_text(json.dumps(summary))
    page = render_report([d], d / "report.html").read_text()
    assert '<th>bytes / learner / inner step up (steady)</th><td class="v">–</td>' in page
    assert "traffic per learner" not in page


def test_a_bucket_never_counts_a_learner_busier_than_the_bucket_is_long():
    """A restarted process's first reading is placed at the latest it can have started, which
    may overlap its predecessor's last: the bucket still counts that learner at most 100%."""
    from ddiloco.report.run_view import Run

    records = [
        {"time": 10.0, "learner": 0, "incarnation": 1, "busy_s": 10.0},
        {"time": 20.0, "learner": 0, "incarnation": 1, "busy_s": 20.0},
        {"time": 21.0, "learner": 0, "incarnation": 2, "busy_s": 6.0},  # "started" at 15: overlaps the first
        {"time": 30.0, "learner": 0, "incarnation": 2, "busy_s": 15.0},
    ]
    run = Run(path=Path("x"), learners=records, summary={}, accounting={"horizon_s": 30.0, "learners": 1})
    _, values, _ = goodput_series(run, buckets=6)
    assert max(values) <= 1.0 + 1e-9


def test_an_evaluate_hooks_other_figures_are_in_the_report(tmp_path):
    """SyncerServer(evaluate=) returning {"loss", "accuracy"}: the accuracy has its figure and
    the final one its row (issue 35: it was missing from the report)."""
    d = make_run(tmp_path / "hooked")
    evals = [json.loads(line) for line in (d / "metrics" / "eval.jsonl").read_text().splitlines() if line.endswith("}")]
    for i, e in enumerate(evals):
        e["metrics"] = {"accuracy": 0.5 + 0.04 * i}
    (d / "metrics" / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    summary["eval_metrics"] = {"accuracy": evals[-1]["metrics"]["accuracy"]}
    (d / "summary.json").write_text(json.dumps(summary))
    page = render_report([d], d / "report.html").read_text()
    figs = figures(page)
    assert len(pngs(figs["eval-metrics"])) == 1
    assert "final eval accuracy" in page and f"{evals[-1]['metrics']['accuracy']:.4f}" in page
