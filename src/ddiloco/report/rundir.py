"""The run folder: resolved config, JSONL metrics, event tape, loss plot, final model.

Every run folder carries ``run.json`` with its format version; a folder of another format (or
an older one without the file) is refused before anything is written into it.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import tomli_w
from safetensors.torch import save_file

from ddiloco.config import Config, to_dict
from ddiloco.errors import DDiLoCoError
from ddiloco.report.result import RunResult

RUN_FORMAT = 2
"""Version of the run-folder layout (docs/operations.md, "The run folder format"; 2: run.json
gains ``started_at``, config.toml is written once when the folder is made and checked by every
later command)."""


ARTIFACTS = ("config.toml", "state", "status", "metrics", "metrics.jsonl", "tape.jsonl", "summary.json", "final")
"""What ddiloco writes into a run folder: a folder holding any of these is a run folder."""

MODEL_INFO = "model.json"
"""What a run's model is when it was built in Python (``ddiloco.SyncerServer``), not by the
config's workload: ``{"module", "class", "parameters", "by", "hf_config"}``. ``hf_config`` is a
Hugging Face model's own config (its ``to_json_string``, null for other models), from which
``ddiloco export --format hf`` rebuilds the model. Without this file, ``workload.*`` in
config.toml describes the model."""

UNCHECKED = ("run.threads", "run.run_dir")
"""Config keys (besides every ``runtime.*``) that may differ between a run folder's saved
config and a later command on it."""


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a run folder (ddiloco's ``run.json`` or any of its artifacts)."""
    d = Path(path)
    return (d / "run.json").exists() or any((d / name).exists() for name in ARTIFACTS)


def prepare_run_dir(run_dir: str | Path, by: str, cfg: Config | None = None) -> Path:
    """Create ``run_dir`` with its ``run.json``, or check an existing one is of this format.

    A missing folder, or one without ddiloco's files (say, only the logs a user redirected
    there), is fine. A run folder without ``run.json`` was written by an older ddiloco, and one
    of another format cannot be read back correctly: both are refused with what to do, before
    anything is written. With ``cfg``, a saved ``config.toml`` must agree with it in everything
    but ``runtime.*``, ``run.threads`` and ``run.run_dir`` (else refused, naming the first key
    that differs), and a folder without one gets ``cfg`` written as its ``config.toml``.
    """
    d = Path(run_dir)
    marker = d / "run.json"
    if is_run_dir(d):
        try:
            found = json.loads(marker.read_text()).get("format")
        except FileNotFoundError:
            found = None
        except (OSError, ValueError, AttributeError):
            found = "unreadable"
        if found == RUN_FORMAT - 1:
            raise DDiLoCoError(
                f"run folder {d} is of format {found}, this ddiloco writes format {RUN_FORMAT}: migrate it in place "
                f"with `ddiloco migrate {d}` (stop its syncer first), or choose another folder"
            )
        if found != RUN_FORMAT:
            what = f"is of format {found}" if found is not None else "has no run.json (an older ddiloco's?)"
            raise DDiLoCoError(
                f"run folder {d} {what}; this ddiloco writes format {RUN_FORMAT}: choose another folder "
                "(--run-dir or run.run_dir) or move that one away"
            )
        if cfg is not None:
            if (d / "config.toml").exists():
                check_saved_config(d, cfg)
            else:
                _write_config(d, cfg)
        return d
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"run.json.{os.getpid()}.tmp"  # processes of one run may start together
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    tmp.write_text(json.dumps({"format": RUN_FORMAT, "created": stamp, "by": by, "started_at": time.time()}))
    os.replace(tmp, marker)
    if cfg is not None:
        _write_config(d, cfg)
    return d


def _write_config(d: Path, cfg: Config) -> None:
    tmp = d / f"config.toml.{os.getpid()}.tmp"
    tmp.write_text(tomli_w.dumps(to_dict(cfg)))
    os.replace(tmp, d / "config.toml")


def write_model_info(run_dir: str | Path, model: object, by: str) -> Path:
    """Describe ``model``, built in Python, in ``run_dir/model.json`` (``MODEL_INFO``), replaced
    atomically: a restart writes the same."""
    import torch

    cls = type(model)
    hf_config = None
    config = getattr(model, "config", None)
    if callable(getattr(model, "save_pretrained", None)) and callable(getattr(config, "to_json_string", None)):
        try:  # the library's own serialiser (dtypes and the like as JSON)
            hf_config = json.loads(config.to_json_string(use_diff=False))  # type: ignore[union-attr]
        except (TypeError, ValueError):
            hf_config = None
    params = sum(p.numel() for p in model.parameters()) if isinstance(model, torch.nn.Module) else 0
    info = {"module": cls.__module__, "class": cls.__qualname__, "parameters": params, "by": by,
            "hf_config": hf_config}  # fmt: skip
    path = Path(run_dir) / MODEL_INFO
    tmp = path.with_name(f".{MODEL_INFO}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)
    return path


def config_difference(saved: Config, cfg: Config) -> tuple[str, object, object] | None:
    """The first key (``section.key``, in config order) whose value differs between ``saved``
    and ``cfg``, ignoring ``runtime.*`` and ``UNCHECKED``; None when they agree."""
    old, new = to_dict(saved), to_dict(cfg)
    for section, values in new.items():
        if section == "runtime":
            continue
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in UNCHECKED and old[section][key] != value:
                return name, old[section][key], value
    return None


def check_saved_config(run_dir: str | Path, cfg: Config) -> None:
    """Refuse (one line) when ``run_dir/config.toml`` differs from ``cfg`` in a checked key."""
    from ddiloco.config import load_config

    path = Path(run_dir) / "config.toml"
    try:
        saved = load_config(path)
    except DDiLoCoError as e:
        raise DDiLoCoError(
            f"run folder {run_dir}: its saved config.toml cannot be read by this ddiloco ({e})"
        ) from None
    grows = cfg.run.num_learners > saved.run.num_learners
    if grows:  # the documented way to grow the fleet: restart with a larger cap (ids, data shards)
        saved = replace(saved, run=replace(saved.run, num_learners=cfg.run.num_learners))
    diff = config_difference(saved, cfg)
    if diff is not None:
        name, old, new = diff
        raise DDiLoCoError(
            f"run folder {run_dir} was made with {name} = {old!r}, but this command has {name} = {new!r}; only "
            "runtime.*, run.threads and a larger run.num_learners may change on a run: use its config.toml, "
            "--resume it, or choose another folder"
        )
    if grows:
        _write_config(Path(run_dir), saved)  # the folder records the cap it now runs with


def choose_run_dir(
    cfg_run_dir: str | Path,
    method: str,
    run_dir_arg: str | Path | None = None,
    resume_arg: str | Path | None = None,
    now: dt.datetime | None = None,
    can_resume: bool = True,
) -> tuple[Path, bool]:
    """The run folder of a ``train`` or ``simulate`` and whether it continues an earlier run.

    ``--resume RUN_DIR``: that run folder (it must be one). ``--run-dir DIR``: that folder, which
    must not hold a run yet. Otherwise ``run.run_dir``: a path named ``latest`` (the default,
    ``runs/latest``) means a fresh ``METHOD-YYYYmmdd-HHMMSS`` folder next to it (``-2``, ``-3``
    ... when taken) with ``latest`` pointed at it; any other path is used like ``--run-dir``.
    ``can_resume``: whether the command has ``--resume`` (the refusal of a used folder says so).
    """
    if run_dir_arg is not None and resume_arg is not None:
        raise DDiLoCoError("give --run-dir DIR (a new run) or --resume RUN_DIR (continue one), not both")
    if resume_arg is not None:
        d = Path(resume_arg)
        if not d.is_dir() or not is_run_dir(d):
            raise DDiLoCoError(
                f"--resume {d}: no run folder there; pass a folder an earlier run wrote (it has run.json)"
            )
        return d.resolve(), True
    if run_dir_arg is None and Path(cfg_run_dir).name != "latest":
        run_dir_arg = cfg_run_dir
    if run_dir_arg is not None:
        d = Path(run_dir_arg)
        if is_run_dir(d):
            what = f"continue it with --resume {d}, or choose" if can_resume else "choose"
            raise DDiLoCoError(f"{d} already holds a run; {what} another folder (or move that one away)")
        return d, False
    return fresh_run_dir(Path(cfg_run_dir).parent, method, now), False


def fresh_run_dir(parent: str | Path, method: str, now: dt.datetime | None = None) -> Path:
    """Make ``parent/METHOD-YYYYmmdd-HHMMSS`` (``-2``, ``-3`` ... if taken) and point
    ``parent/latest`` at it (see ``point_latest``)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    stem = f"{method}-{(now or dt.datetime.now()).strftime('%Y%m%d-%H%M%S')}"
    for n in itertools.count(1):
        d = parent / (stem if n == 1 else f"{stem}-{n}")
        try:
            d.mkdir()  # atomic: two runs started in the same second get different folders
        except FileExistsError:
            continue
        point_latest(d)
        return d
    raise AssertionError("unreachable")  # pragma: no cover


def point_latest(run_dir: Path) -> Path:
    """Point ``latest`` next to ``run_dir`` at it: a relative symlink, replaced atomically; where
    symlinks cannot be made (or ``latest`` is a real folder, an older run), ``LATEST`` names it.
    Returns the link (or the file) written."""
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest.{os.getpid()}.tmp"
    try:
        if link.is_symlink() or not link.exists():
            tmp.unlink(missing_ok=True)
            os.symlink(run_dir.name, tmp, target_is_directory=True)
            os.replace(tmp, link)
            return link
    except OSError:
        tmp.unlink(missing_ok=True)
    text = run_dir.parent / "LATEST"
    if link.exists() and not link.is_symlink():
        import warnings

        warnings.warn(
            f"{link} is a folder (an older run), not a link: left as it is; {text} names the new run", stacklevel=2
        )
    tmp_text = run_dir.parent / f".LATEST.{os.getpid()}.tmp"
    tmp_text.write_text(run_dir.name + "\n")
    os.replace(tmp_text, text)
    return text


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
    kinds = {"fail": "fail", "rejoin": "restart", "straggle": "straggle", "straggle_end": "straggle_end"}
    faults = sorted(
        (
            {
                "event": "fault",
                "time": e["time"],
                "kind": kinds[e["event"]],
                "target": f"learner-{e['learner']}",
                **({"factor": e["factor"]} if "factor" in e else {}),
            }  # fmt: skip
            for e in result.log
            if e.get("event") in kinds
        ),
        key=lambda f: f["time"],
    )
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
    if result.traffic is not None:
        (d / "metrics" / "traffic.json").write_text(json.dumps(result.traffic, indent=2))
    with open(d / "tape.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in result.tape)
    save_file({k: v.contiguous() for k, v in result.state.items()}, str(d / "final" / "model.safetensors"))
    write_summary(d)
    return d
