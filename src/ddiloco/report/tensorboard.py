"""TensorBoard scalars from a run folder's metrics (the optional ``tensorboard`` extra).

The JSON-lines files under ``metrics/`` stay the one source of every metric; this writes the
same figures, under the same names, as TensorBoard event files, once (``ddiloco tensorboard
RUN_DIR``) or following the files as the run appends to them (``--follow``), so ``tensorboard
--logdir RUN_DIR/tensorboard`` shows a run live, wherever it was started.

Scalar names (``docs/operations.md`` defines each figure), with the run's time in seconds as the
step (a scalar's step must be an integer: it is rounded to the millisecond, ``walltime`` carries
the exact value):

- ``eval/loss``, ``eval/merged_tokens`` and ``eval/NAME`` for each of an evaluation hook's other
  metrics (``metrics/eval.jsonl``);
- ``learner/M/loss``, ``learner/M/tokens``, ``learner/M/steps``, ``learner/M/busy_s``,
  ``learner/M/bytes_sent`` (``metrics/learners.jsonl``);
- ``summary/KEY`` for every number in ``summary.json`` (written once, at the end);
- ``traffic/KEY`` for summary.json's traffic figures (``TRAFFIC_KEYS``: steady bytes per learner
  per inner step up and down, one-off bytes, data-parallel's and the ratios to it) and
  ``traffic/learner/M/up_bytes_per_step`` and ``.../down_bytes_per_step`` (at the end too).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddiloco.errors import DDiLoCoError
from ddiloco.report.tape import MAX_LINE_BYTES

log = logging.getLogger(__name__)

EVAL_KEYS = ("loss", "merged_tokens")
LEARNER_KEYS = ("loss", "tokens", "steps", "busy_s", "bytes_sent")
TRAFFIC_KEYS = ("up_bytes_per_step", "down_bytes_per_step", "one_off_up_bytes", "one_off_down_bytes",
                "dp_bytes_per_step", "dp_ratio_up", "dp_ratio_down")  # fmt: skip
STEP_SCALE = 1000
"""Steps are the run's time in milliseconds (TensorBoard steps are integers)."""


def traffic_scalars(summary: dict[str, Any]) -> list[tuple[str, float]]:
    """(tag, value) of summary.json's traffic figures (none when the run counted no traffic)."""
    traffic = summary.get("traffic")
    if not isinstance(traffic, dict):
        return []
    values = [(f"traffic/{k}", traffic.get(k)) for k in TRAFFIC_KEYS]
    by = traffic.get("by_learner")
    for m, row in by.items() if isinstance(by, dict) else ():
        if isinstance(row, dict):
            values += [(f"traffic/learner/{m}/{k}", row.get(k)) for k in ("up_bytes_per_step", "down_bytes_per_step")]
    return [(tag, float(v)) for tag, v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def scalar_records(name: str, record: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(tag, value, time) of every scalar in one JSONL record of ``metrics/NAME.jsonl``."""
    t = record.get("time")
    if not isinstance(t, (int, float)):
        return []
    out = []
    if name == "eval":
        keys, prefix = EVAL_KEYS, "eval/"
    elif name == "learners" and isinstance(record.get("learner"), int):
        keys, prefix = LEARNER_KEYS, f"learner/{record['learner']}/"
    else:
        return []
    values = {key: record.get(key) for key in keys}
    extra = record.get("metrics") if name == "eval" else None
    if isinstance(extra, dict):  # an evaluation hook's other metrics: eval/accuracy ...
        values.update({str(k): v for k, v in extra.items() if str(k) not in values})
    for key, v in values.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((prefix + key, float(v), float(t)))
    return out


class _Tail:
    """Reads the whole lines a growing file has gained since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""

    def lines(self, limit: int = 1 << 20) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(limit)
        except OSError:
            return []
        self.offset += len(data)
        chunk = self.rest + data
        *whole, self.rest = chunk.split(b"\n")
        if len(self.rest) > MAX_LINE_BYTES:  # a runaway line: drop it rather than hold it
            self.rest = b""
        out = []
        for line in whole:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn or garbled line
            if isinstance(rec, dict):
                out.append(rec)
        return out


def _writer(logdir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise DDiLoCoError(
            "TensorBoard output needs the tensorboard package: pip install 'ddiloco[tensorboard]'"
        ) from None
    return SummaryWriter(log_dir=str(logdir))


def export_scalars(
    run_dir: str | Path,
    logdir: str | Path | None = None,
    follow: bool = False,
    interval_s: float = 2.0,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[Path, int]:
    """Write the run's metrics as TensorBoard scalars into ``logdir`` (default
    RUN_DIR/tensorboard); with ``follow``, keep appending what the run adds until it ends
    (its summary is written) or ``should_stop``. Returns (logdir, scalars written)."""
    d = Path(run_dir)
    if not (d / "run.json").exists():
        raise DDiLoCoError(f"{d} is not a run folder (no run.json); give the folder a run wrote")
    out = Path(logdir) if logdir is not None else d / "tensorboard"
    writer = _writer(out)
    tails = {name: _Tail(d / "metrics" / f"{name}.jsonl") for name in ("eval", "learners")}
    written = 0
    try:
        while True:
            for name, tail in tails.items():
                for rec in tail.lines():
                    for tag, value, t in scalar_records(name, rec):
                        writer.add_scalar(tag, value, global_step=round(t * STEP_SCALE), walltime=t)
                        written += 1
            summary = _summary(d)
            if not follow or should_stop() or (summary is not None and _over(d)):
                if summary is not None:
                    step = round(float(summary.get("run_time_s") or 0.0) * STEP_SCALE)
                    for key, value in summary.items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            writer.add_scalar(f"summary/{key}", float(value), global_step=step)
                            written += 1
                    for tag, value in traffic_scalars(summary):
                        writer.add_scalar(tag, value, global_step=step)
                        written += 1
                break
            writer.flush()
            time.sleep(interval_s)
    finally:
        writer.close()
    return out, written


def _summary(d: Path) -> dict[str, Any] | None:
    from ddiloco.report.tape import read_json

    return read_json(d / "summary.json") or None


def _over(d: Path) -> bool:
    """The run has ended or was interrupted (and not resumed since)."""
    from ddiloco.report.tape import read_jsonl

    runlog = read_jsonl(d / "metrics" / "run.jsonl")
    return bool(runlog) and runlog[-1].get("what") in ("end", "interrupted")
