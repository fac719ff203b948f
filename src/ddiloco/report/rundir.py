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
    """Write everything a run produced; returns the folder."""
    d = prepare_run_dir(run_dir, f"ddiloco {result.method}")
    (d / "final").mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text(tomli_w.dumps(to_dict(cfg)))
    with open(d / "metrics.jsonl", "w") as f:
        for e in result.evals:
            f.write(json.dumps({"event": "eval", **e}) + "\n")
        for e in result.log:
            f.write(json.dumps(e) + "\n")
        f.write(json.dumps({"event": "summary", **result.summary()}) + "\n")
    with open(d / "tape.jsonl", "w") as f:
        for e in result.tape:
            f.write(json.dumps(e) + "\n")
    (d / "summary.json").write_text(json.dumps(result.summary(), indent=2))
    save_file({k: v.contiguous() for k, v in result.state.items()}, str(d / "final" / "model.safetensors"))
    plot_eval_loss(result, d / "eval_loss.png")
    return d


def plot_eval_loss(result: RunResult, path: Path) -> None:
    """Eval loss of the global model against virtual time, with failures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([e["time"] for e in result.evals], [e["loss"] for e in result.evals], marker="o", label=result.method)
    for e in result.log:
        # simulator: {"event": "fail", "time"}; real runtime: {"event": "fault", "kind": "sigkill", "t"}
        if e.get("event") == "fail" or (e.get("event") == "fault" and e.get("kind") != "restart"):
            ax.axvline(e.get("t", e["time"]), color="red", alpha=0.25, lw=1)
    ax.set_xlabel("time since start (s; virtual in simulate)")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title(f"{result.method}: global model eval loss (red: learner failures)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
