"""A run's life from the user's side: it ends by itself at its budget (the syncer decides), a
signal stops it cleanly with partial results, and no process of a run survives it. Real
processes on loopback with the small synthetic model; every wait is bounded, and only
outcomes are asserted, never durations."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import wait_for
from test_report_html import FIGURES, figures, pngs
from test_runtime import ENV, SETTINGS, read

from ddiloco.config import load_config
from ddiloco.service.base.clock import SYSTEM_CLOCK
from ddiloco.service.learner.process import EXIT_COMM_DIED, LearnerProcess
from ddiloco.service.ops.launcher import free_port

CLI = [sys.executable, "-m", "ddiloco.cli"]


def survivors(marker: str) -> list[str]:
    """Processes (other than this one) whose command line mentions ``marker`` (a run folder)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":  # a zombie is dead (its parent reaps it)
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def lines(path: Path) -> list[dict]:
    from ddiloco.report.tape import read_jsonl

    return read_jsonl(path)


@pytest.mark.slow  # spawns processes
def test_ctrl_c_on_train_stops_cleanly_writes_partial_results_and_leaves_no_process(tmp_path):
    """SIGINT once: learners, evaluator and syncer stop, the summary is written and marked
    partial; a second signal during that cleanup is ignored (and said to be)."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        [*CLI, "train", "--run-dir", str(run_dir), *SETTINGS, "--set", "runtime.duration_s=600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only (children lead their own groups)
    )
    try:
        wait_for(lambda: all(read(run_dir / "status" / f"learner-{m}.json").get("steps", 0) > 5 for m in (0, 1)),
                 120, "both learners to train")  # fmt: skip
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)  # the second one, during cleanup
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "ignored: already stopping cleanly" in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partial"] is True and any("interrupted" in w for w in summary["warnings"])
    assert "PARTIAL" in out and summary["tokens_processed"] > 0
    for name in ("metrics.jsonl", "tape.jsonl", "final/model.safetensors", "metrics/accounting.json"):
        assert (run_dir / name).is_file(), name
    assert lines(run_dir / "metrics" / "run.jsonl")[-1]["what"] == "interrupted"
    wait_for(lambda: not survivors(str(run_dir)), 10, "every process of the run to be gone")
    # keys by default: the run's own, in its folder, and every child ran with them
    assert (run_dir / "keys" / "syncer.key_secret").is_file() and (run_dir / "keys" / "learner-1.key_secret").is_file()
    assert not any("INSECURE" in (run_dir / "logs" / f"{n}.log").read_text() for n in ("syncer", "learner-0"))
    # the run folder is the truth: its state deleted, a resume is refused in one line, nothing started
    shutil.rmtree(run_dir / "state")
    out = subprocess.run(
        [*CLI, "train", "--resume", str(run_dir)], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert out.returncode == 2 and "is missing or empty" in out.stderr and "--start-over" in out.stderr, out.stderr
    assert not (run_dir / "state").exists()


@pytest.mark.slow  # spawns processes
def test_ctrl_c_on_simulate_writes_a_partial_run_folder(tmp_path):
    run_dir = tmp_path / "sim"
    p = subprocess.Popen(
        [
            *CLI, "simulate", "--run-dir", str(run_dir), "--set",
            "workload.factory=ddiloco.workloads.synthetic:make_workload", "--set", "run.processed_tokens=50000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )  # fmt: skip
    try:
        wait_for(lambda: (run_dir / "run.json").exists(), 60, "the simulation to start")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partial"] is True and summary["clock"] == "virtual"
    assert lines(run_dir / "metrics" / "eval.jsonl")[-1]["final"] is True  # the model as it was, evaluated


@pytest.mark.slow  # spawns processes
def test_a_learner_stopped_by_a_signal_before_the_end_exits_130_and_one_started_again_finishes_with_0(tmp_path):
    """What a supervisor needs (a Kubernetes Job, a Slurm requeue): a learner drained or preempted
    mid-run is not done (130, so it is started again); started again it rejoins, and once the run
    has ended it exits 0."""
    run_dir = tmp_path / "run"
    host = "127.0.0.6"
    addr = f"tcp://{host}:{free_port(host)}"
    budget = [
        *SETTINGS,
        "--set",
        "run.processed_tokens=6000",
        "--set",
        "run.num_learners=1",
        "--set",
        "runtime.end_linger_s=2",
    ]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("syncer", "first", "again")}  # noqa: SIM115
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([*CLI, *args, *budget], stdout=logs[name], stderr=subprocess.STDOUT, env=ENV))
        return procs[-1]

    learner = ["learner", "--syncer", addr, "--id", "0", "--run-dir", str(run_dir)]
    try:
        syncer = start("syncer", "syncer", "--bind", addr, "--run-dir", str(run_dir))
        first = start("first", *learner)
        wait_for(lambda: (read(run_dir / "status" / "learner-0.json") or {}).get("steps", 0) > 0, 300, "a step")
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 130
        assert start("again", *learner).wait(timeout=600) == 0
        assert syncer.wait(timeout=600) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    said = {name: (tmp_path / f"{name}.log").read_text() for name in logs}
    assert "SIGTERM received" in said["first"] and "the syncer ended the run" in said["again"], said


@pytest.mark.slow  # spawns processes
def test_a_hand_started_run_ends_by_itself_and_reports_at_the_top_of_its_folder(tmp_path):
    """Syncer, two learners and an evaluator started separately (as docs/operations.md shows):
    the syncer ends the run at its token budget, runs the final sync, and every process exits 0;
    tape, metrics, summary and plot are at the top of the folder. A second syncer on the same
    folder is refused (its lock), and one restarted on the finished run says so and leaves."""
    run_dir = tmp_path / "run"
    host = "127.0.0.6"
    addr = f"tcp://{host}:{free_port(host)}"
    # A token budget is work: the run cannot end before the learners trained, however long a busy
    # machine takes to start them (a 12 s time budget once ended before any learner had stepped).
    budget = [*SETTINGS, "--set", "run.processed_tokens=3000", "--set", "runtime.eval_interval_s=2"]
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *args: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        procs[name] = subprocess.Popen([*CLI, *args, *budget], stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV)
        return procs[name]

    try:
        start("syncer", "syncer", "--bind", addr, "--run-dir", str(run_dir))
        # Bounds, not durations: with two CPU burners ahead of it a syncer once took over 60 s to come up.
        wait_for(lambda: read(run_dir / "status" / "syncer-0.json"), 300, "the syncer to come up")
        second = subprocess.run(
            [*CLI, "syncer", "--bind", f"tcp://{host}:{free_port(host)}", "--run-dir", str(run_dir), *budget],
            capture_output=True, text=True, env=ENV, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2 and "in use by another syncer" in second.stderr, second.stderr[-2000:]
        for m in (0, 1):
            start(f"learner-{m}", "learner", "--syncer", addr, "--id", str(m), "--run-dir", str(run_dir))
        start("evaluator", "evaluator", "--syncer", addr, "--run-dir", str(run_dir))
        codes = {name: p.wait(timeout=600) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    assert codes == dict.fromkeys(procs, 0), {n: logs[n][-1500:] for n, c in codes.items() if c}
    assert "the syncer ended the run" in logs["learner-0"] and "final sync done" in logs["syncer"]
    runlog = lines(run_dir / "metrics" / "run.jsonl")
    assert [r["what"] for r in runlog] == ["start", "end"] and "(run.processed_tokens)" in runlog[-1]["reason"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partial"] is False and summary["eval_loss"] is not None and summary["loss_unit"] == "MSE"
    assert 0 < summary["goodput"] <= 1 and summary["down"] is None  # from the learners' own reports
    assert summary["tokens_processed"] > 0 and summary["rounds_per_fragment"] > 0
    for name in ("tape.jsonl", "metrics.jsonl", "eval_loss.png", "final/model.safetensors"):
        assert (run_dir / name).is_file(), name
    tape = lines(run_dir / "tape.jsonl")
    rounds = [r for r in tape if r["event"] == "round"]
    assert rounds and all("wall_offset" not in r for r in rounds)
    assert all(-5 < r["closed_at"] < summary["run_time_s"] + 60 for r in rounds)  # seconds since the start
    assert any(r["close_reason"] == "final" for r in rounds)  # the final sync took place
    assert lines(run_dir / "metrics" / "eval.jsonl")[-1]["final"] is True
    assert lines(run_dir / "metrics" / "learners.jsonl")
    again = subprocess.run(
        [*CLI, "syncer", "--bind", addr, "--run-dir", str(run_dir), *budget, "--set", "runtime.end_linger_s=0.5"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0 and "this run already ended" in again.stderr, again.stderr[-2000:]
    assert [r["what"] for r in lines(run_dir / "metrics" / "run.jsonl")] == ["start", "end"]
    assert not survivors(str(run_dir))
    # `ddiloco report` on this real run next to a simulated one: every figure, drawn from data.
    sim = tmp_path / "sim"
    out = subprocess.run(
        [*CLI, "simulate", "--run-dir", str(sim), "--set", "workload.factory=ddiloco.workloads.synthetic:make_workload",
         "--set", "run.processed_tokens=20000"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = subprocess.run(
        [*CLI, "report", str(run_dir), str(sim), "-o", str(tmp_path / "report.html")],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    page = (tmp_path / "report.html").read_text()
    figs = figures(page)
    assert set(figs) == set(FIGURES) and "No data" not in page
    for fid in FIGURES:
        assert pngs(figs[fid]) and all(len(png) > 5000 for png in pngs(figs[fid])), fid


class DyingSocket:
    """A transport whose receive fails: the comm thread dies with it."""

    def send(self, link, frames):
        return True

    def recv(self, timeout_s):
        raise RuntimeError("the transport broke")

    def wake(self):
        pass

    def close(self, linger_s=0.0):
        pass


def test_a_dead_comm_thread_ends_the_learner_with_its_exit_code_and_one_line(tmp_path, caplog):
    cfg = load_config(None, [s for s in SETTINGS if s != "--set"])
    ln = LearnerProcess(cfg, ["tcp://127.0.0.1:1"], 0, tmp_path, connect=lambda a, i: DyingSocket(), clock=SYSTEM_CLOCK)
    code: list[int] = []
    t = threading.Thread(target=lambda: code.append(ln.run()))
    t.start()
    t.join(timeout=60)
    assert code == [EXIT_COMM_DIED]
    assert any("comm thread died (RuntimeError: the transport broke)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", ["127.0.0.1:48911", "tcp://127.0.0.1", "tcp://127.0.0.1:0"])
@pytest.mark.slow  # spawns processes
def test_a_learner_address_without_scheme_or_port_is_refused_at_parse_time(bad):
    out = subprocess.run(
        [*CLI, "learner", "--syncer", bad, "--id", "0"], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert out.returncode == 2 and "--syncer" in out.stderr and "Traceback" not in out.stderr


def test_a_resumed_train_run_adds_its_accounting_to_the_earlier_sessions():
    from ddiloco.service.ops.launcher import _add_sessions

    first = {
        "horizon_s": 10.0, "tokens": 100, "compute_s": 18.0, "down_s": 1.0, "restarting_s": 0.5, "starting_s": 0.5,
        "blocked_s": 0.0, "lost_steps": 3.0, "uptime": 1.0, "restart_latencies_s": [0.5],
    }  # fmt: skip
    second = {**first, "horizon_s": 30.0, "tokens": 300, "uptime": 0.5, "restart_latencies_s": [1.5]}
    once = _add_sessions(None, first)
    assert once["sessions"] == 1 and once["tokens"] == 100
    both = _add_sessions(once, second)
    assert both["sessions"] == 2 and both["horizon_s"] == 40.0 and both["tokens"] == 400
    assert both["compute_s"] == 36.0 and both["uptime"] == (1.0 * 10 + 0.5 * 30) / 40
    assert both["restart_latencies_s"] == [0.5, 1.5]
    assert _add_sessions({"tokens": "garbage"}, second)["tokens"] == 300  # a damaged file is not trusted


def test_a_straggler_phase_is_a_fault_record_and_faults_injected_counts_no_restart():
    """The launcher's duty cycle says when a straggler phase starts (its factor) and ends; the
    progress line's "faults injected" counts kills and phases, not restarts or phase ends."""
    from types import SimpleNamespace

    from ddiloco.chaos.schedule import ChaosSchedule, Straggler
    from ddiloco.report.summary import is_injected
    from ddiloco.service.ops.launcher import Launcher, Proc

    recorded: list[dict] = []
    procs = [Proc("learner-0", []), Proc("learner-1", [])]
    fake = SimpleNamespace(learners=procs, _phases_said=set(), _fault=lambda kind, target, **x: recorded.append(
        {"kind": kind, "target": target, **x}))  # fmt: skip
    # two adjacent phases of one learner are two phases, as the simulator counts them
    schedule = ChaosSchedule(stragglers=(Straggler(1, 1.5, 10.0, 20.0), Straggler(1, 2.0, 20.0, 30.0)))
    for t in (5.0, 10.2, 12.0, 15.7, 20.1, 25.0, 31.0, 32.0):
        Launcher._duty_cycle(fake, schedule, t)  # (not alive: no signal is sent)
    assert recorded == [
        {"kind": "straggle", "target": "learner-1", "factor": 1.5},
        {"kind": "straggle_end", "target": "learner-1"},
        {"kind": "straggle", "target": "learner-1", "factor": 2.0},
        {"kind": "straggle_end", "target": "learner-1"},
    ]
    assert len(schedule.straggler_events(40.0)) == 4  # the simulator's count of the same schedule
    kinds = ["sigkill", "restart", "straggle", "straggle_end", "exit 1", "fail"]
    assert [is_injected({"kind": k}) for k in kinds] == [True, False, True, False, False, True]
