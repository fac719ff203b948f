"""`ddiloco tensorboard`: the run folder's metrics as TensorBoard scalars, under the documented names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.cli import main
from ddiloco.report.tensorboard import export_scalars, scalar_records


def _run_folder(d: Path) -> Path:
    (d / "metrics").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"format": 2, "started_at": 0.0, "by": "test"}))
    evals = [{"event": "eval", "time": 1.5 * k, "loss": 3.0 - k, "merged_tokens": 100.0 * k} for k in range(3)]
    learners = [
        {"event": "learner", "time": float(t), "learner": m, "state": "up", "steps": t, "tokens": 10 * t,
         "busy_s": 0.5 * t, "loss": None if t == 0 else 2.0 / t, "bytes_sent": 64 * t}
        for t in range(4) for m in (0, 1)
    ]  # fmt: skip
    (d / "metrics" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals) + "{torn")
    (d / "metrics" / "learners.jsonl").write_text("".join(json.dumps(r) + "\n" for r in learners))
    (d / "metrics" / "run.jsonl").write_text(json.dumps({"event": "run", "time": 4.0, "what": "end"}) + "\n")
    traffic = {"up_bytes_per_step": 150.0, "down_bytes_per_step": 100.0, "dp_ratio_up": 26.5, "dp_ratio_down": None,
               "by_learner": {"0": {"up_bytes_per_step": 140.0, "down_bytes_per_step": 90.0}}}  # fmt: skip
    summary = {"goodput": 0.9, "eval_loss": 1.0, "run_time_s": 4.0, "method": "x", "traffic": traffic}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_metric_is_a_scalar_with_its_documented_name(tmp_path):
    d = _run_folder(tmp_path / "run")
    out, n = export_scalars(d)
    assert out == d / "tensorboard"
    scalars = _read_scalars(out)
    assert scalars["eval/loss"] == [(0, 3.0), (1500, 2.0), (3000, 1.0)]  # steps: the run's time in ms
    assert [v for _, v in scalars["eval/merged_tokens"]] == [0.0, 100.0, 200.0]
    for m in (0, 1):
        assert [v for _, v in scalars[f"learner/{m}/tokens"]] == [0.0, 10.0, 20.0, 30.0]
        assert len(scalars[f"learner/{m}/loss"]) == 3  # an unknown loss (null) is not invented
        for key in ("steps", "busy_s", "bytes_sent"):
            assert len(scalars[f"learner/{m}/{key}"]) == 4
    assert scalars["summary/goodput"] == [(4000, pytest.approx(0.9))] and "summary/method" not in scalars
    assert scalars["traffic/up_bytes_per_step"] == [(4000, 150.0)] and scalars["traffic/dp_ratio_up"] == [(4000, 26.5)]
    assert scalars["traffic/learner/0/down_bytes_per_step"] == [(4000, 90.0)]
    assert "traffic/dp_ratio_down" not in scalars  # unknown: not invented
    assert n == sum(len(v) for v in scalars.values())


def test_records_without_a_time_or_with_other_events_give_nothing():
    assert scalar_records("eval", {"loss": 1.0}) == []
    assert scalar_records("learners", {"time": 1.0, "learner": "x", "loss": 1.0}) == []
    assert scalar_records("faults", {"time": 1.0, "kind": "sigkill"}) == []
    assert scalar_records("eval", {"time": 2.0, "loss": True}) == []  # a bool is not a number


def test_the_command_writes_and_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    d = _run_folder(tmp_path / "run")
    assert main(["tensorboard", str(d), "--logdir", str(tmp_path / "tb")]) == 0
    assert "scalars written to" in capsys.readouterr().out and any((tmp_path / "tb").iterdir())
    assert main(["tensorboard", str(tmp_path)]) == 2
    assert "is not a run folder" in capsys.readouterr().err
