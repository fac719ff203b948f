"""The run folder: resolved config, JSONL metrics, event tape, loss plot, final model."""

from __future__ import annotations

import json
from pathlib import Path

import tomli_w
from safetensors.torch import save_file

from ddiloco.config import Config, to_dict
from ddiloco.report.result import RunResult


def write_run_dir(run_dir: str | Path, cfg: Config, result: RunResult) -> Path:
    """Write everything a run produced; returns the folder."""
    d = Path(run_dir)
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
