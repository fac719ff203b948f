"""The run folder: resolved config, JSONL metrics, event tape, loss plot, final model.

Every run folder carries ``run.json`` with its format version; a folder of another format (or
an older one without the file) is refused before anything is written into it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import tomli_w
from safetensors.torch import save_file

from ddiloco.config import Config, to_dict
from ddiloco.errors import DDiLoCoError
from ddiloco.report.result import RunResult

RUN_FORMAT = 1
"""Version of the run-folder layout (1: run.json, config.toml, metrics.jsonl, tape.jsonl,
summary.json, eval_loss.png, final/, status/, state/)."""


ARTIFACTS = ("config.toml", "state", "status", "metrics", "metrics.jsonl", "tape.jsonl", "summary.json", "final")
"""What ddiloco writes into a run folder: a folder holding any of these is a run folder."""


def prepare_run_dir(run_dir: str | Path, by: str) -> Path:
    """Create ``run_dir`` with its ``run.json``, or check an existing one is of this format.

    A missing folder, or one without ddiloco's files (say, only the logs a user redirected
    there), is fine. A run folder without ``run.json`` was written by an older ddiloco, and one
    of another format cannot be read back correctly: both are refused with what to do, before
    anything is written.
    """
    d = Path(run_dir)
    marker = d / "run.json"
    if marker.exists() or any((d / name).exists() for name in ARTIFACTS):
        try:
            found = json.loads(marker.read_text()).get("format")
        except FileNotFoundError:
            found = None
        except (OSError, ValueError, AttributeError):
            found = "unreadable"
        if found != RUN_FORMAT:
            what = f"is of format {found}" if found is not None else "has no run.json (an older ddiloco's?)"
            raise DDiLoCoError(
                f"run folder {d} {what}; this ddiloco writes format {RUN_FORMAT}: choose another folder "
                "(--run-dir or run.run_dir) or move that one away"
            )
        return d
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"run.json.{os.getpid()}.tmp"  # processes of one run may start together
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    tmp.write_text(json.dumps({"format": RUN_FORMAT, "created": stamp, "by": by}))
    os.replace(tmp, marker)
    return d


def write_run_dir(run_dir: str | Path, cfg: Config, result: RunResult) -> Path:
    """Write what a simulated run produced in the run folder format (the same source files a
    real run's processes write), then its summary through the one summary function."""
    from ddiloco.report.summary import write_summary

    d = prepare_run_dir(run_dir, "ddiloco simulate")
    (d / "final").mkdir(parents=True, exist_ok=True)
    (d / "metrics").mkdir(parents=True, exist_ok=True)
    if not (d / "config.toml").exists():
        (d / "config.toml").write_text(tomli_w.dumps(to_dict(cfg)))
    evals = [{"event": "eval", **e, "unit": result.loss_unit} for e in result.evals]
    faults = [
        {
            "event": "fault",
            "time": e["time"],
            "kind": "fail" if e["event"] == "fail" else "restart",
            "target": f"learner-{e['learner']}",
        }  # fmt: skip
        for e in result.log
        if e.get("event") in ("fail", "rejoin")
    ]
    end = "interrupted" if result.partial else "end"
    runlog = [
        {"event": "run", "time": 0.0, "what": "start", "reason": ""},
        {"event": "run", "time": result.horizon_s, "what": end,
         "reason": "interrupted (a signal)" if result.partial else f"budget spent (run.budget = {cfg.run.budget})"},
    ]  # fmt: skip
    for name, records in (("eval", evals), ("faults", faults), ("learners", result.samples), ("run", runlog)):
        with open(d / "metrics" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    alloc = result.horizon_s * max(result.num_learners, 1)
    g = result.goodput
    accounting = {
        "method": result.method,
        "horizon_s": result.horizon_s,
        "learners": result.num_learners,
        "num_fragments": result.num_fragments,
        "tokens": result.tokens_processed,
        "tokens_merged": result.tokens_merged,
        "compute_s": g.goodput * alloc,
        "blocked_s": g.blocked * alloc,
        "down_s": g.down * alloc,
        "restarting_s": g.restarting * alloc,
        "uptime": result.uptime,
        "lost_steps": result.lost_steps,
        "tape_stats": {
            k: getattr(result, k)
            for k in ("rounds_per_fragment", "learners_per_merge", "grace_admissions", "rejected", "late")
        },
    }
    (d / "metrics" / "accounting.json").write_text(json.dumps(accounting, indent=2))
    with open(d / "tape.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in result.tape)
    save_file({k: v.contiguous() for k, v in result.state.items()}, str(d / "final" / "model.safetensors"))
    write_summary(d)
    return d
