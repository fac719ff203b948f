"""``ddiloco export``: the global model of a run folder (``final/``, one file or one per syncer
shard) or of a live syncer, written as one safetensors file or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddiloco.config import Config
from ddiloco.errors import DDiLoCoError
from ddiloco.export import FINAL, export_model, fetch_state, load_state_dict, save_state_dict

FORMATS = ("safetensors", "hf")


def final_state(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The final global model a run folder holds: ``final/model.safetensors``, or the union of
    every shard's ``final/model.shard-K.safetensors``."""
    d = Path(run_dir)
    if (d / FINAL).is_file():
        return load_state_dict(d / FINAL)
    shards = sorted((d / "final").glob("model.shard-*.safetensors"), key=_shard_index)
    if not shards:
        raise DDiLoCoError(
            f"{d} holds no final model ({FINAL} or final/model.shard-K.safetensors): the syncer writes it when it "
            "stops; to export a running syncer's model, pass its address (tcp://HOST:PORT)"
        )
    state: dict[str, torch.Tensor] = {}
    for path in shards:
        for name, t in load_state_dict(path).items():
            if name in state and not torch.equal(state[name], t):
                raise DDiLoCoError(f"{path.name} and an earlier shard disagree on {name}: were they of one run?")
            state[name] = t
    return state


def _shard_index(path: Path) -> int:
    try:
        return int(path.name.split(".")[1].removeprefix("shard-"))
    except ValueError:
        return 1 << 30


def _config(config: str | None, run_dir: str | Path | None, source: str) -> Config:
    from ddiloco.config import load_config

    if config is not None:
        return load_config(config)
    if run_dir is not None:
        path = Path(run_dir) / "config.toml"
        if not path.is_file():
            raise DDiLoCoError(f"{run_dir} has no config.toml; pass the run's config with --config FILE")
        return load_config(path)
    raise DDiLoCoError(
        f"exporting from {source} needs the run's config (its model and fragment layout): pass --config FILE or "
        "--run-dir RUN_DIR"
    )


def run_export(
    sources: list[str],
    out: str | None = None,
    fmt: str = "safetensors",
    config: str | None = None,
    run_dir: str | None = None,
    keys: str | None = None,
    insecure: bool = False,
    timeout_s: float = 10.0,
) -> Path:
    """Export the global model of ``sources`` (one run folder or safetensors file, or the
    addresses of a live syncer's shards in shard order); returns what was written."""
    if fmt not in FORMATS:
        raise DDiLoCoError(f"--format {fmt!r} is not known; allowed: {', '.join(FORMATS)}")
    live = any("://" in s for s in sources)
    if live:
        if not all("://" in s for s in sources):
            raise DDiLoCoError("pass either one run folder or the syncer shards' addresses, not both")
        cfg = _config(config, run_dir, sources[0])
        model = _run_model(cfg, run_dir, "exporting from a live syncer")
        from ddiloco.service.base.keys import RUN_KEYS

        if keys is None and not insecure and run_dir is not None and (Path(run_dir) / RUN_KEYS).is_dir():
            keys = str(Path(run_dir) / RUN_KEYS)  # a keyed run (ddiloco train makes keys there): its observer key
        state = fetch_state(model, sources, config=cfg, key=keys, timeout_s=timeout_s, insecure=insecure)
        name = "global-model"
    else:
        if len(sources) != 1:
            raise DDiLoCoError(f"pass one run folder (or .safetensors file), not {len(sources)}")
        src = Path(sources[0])
        if not src.exists():
            raise DDiLoCoError(f"{src} does not exist: pass a run folder, a .safetensors file or tcp://HOST:PORT")
        state = final_state(src) if src.is_dir() else load_state_dict(src)
        name = src.resolve().name if src.is_dir() else src.stem
        cfg = None
        if fmt == "hf":
            run_dir = run_dir or (str(src) if src.is_dir() else None)
            cfg = _config(config, run_dir, str(src))
    if fmt == "safetensors":
        return save_state_dict(state, out or f"{name}.safetensors")
    assert cfg is not None
    model = _run_model(cfg, run_dir, "--format hf")
    if not callable(getattr(model, "save_pretrained", None)):
        raise DDiLoCoError(
            f"--format hf needs a Hugging Face model (one with save_pretrained); workload {cfg.workload.factory} "
            f"builds a {type(model).__name__}: use --format safetensors"
        )
    return export_model(model, state, out or f"{name}-hf")


def _run_model(cfg: Config, run_dir: str | Path | None, purpose: str) -> torch.nn.Module:
    """The run's model: rebuilt from ``model.json`` for a model built in Python (a
    ``SyncerServer`` run), else built by the config's workload."""
    from ddiloco.report.rundir import MODEL_INFO
    from ddiloco.report.tape import read_json

    info = read_json(Path(run_dir) / MODEL_INFO) if run_dir is not None else {}
    if info:
        return _model_from_info(info, Path(run_dir or "."), purpose)
    return _model(cfg)


def _model(cfg: Config) -> torch.nn.Module:
    from ddiloco.workloads.config import load_workload

    return load_workload(cfg.workload).build_model(cfg.run.seed)


def _model_from_info(info: dict[str, Any], run_dir: Path, purpose: str) -> torch.nn.Module:
    """A Hugging Face model rebuilt from its class and config as ``model.json`` records them;
    any other model built in Python is refused in one line saying what to do instead."""
    import importlib

    module, qualname = str(info.get("module", "?")), str(info.get("class", "?"))
    what = f"this run's model, {module}.{qualname}, was built in Python (by {info.get('by', '?')})"
    in_python = (
        f"build the model in Python and call ddiloco.export_model(model, {str(run_dir)!r}, OUT)"
        if purpose == "--format hf"
        else f"build the model in Python and call ddiloco.fetch_state(model, [ADDRESS], key={str(run_dir)!r})"
    )
    hf_config = info.get("hf_config")
    if not isinstance(hf_config, dict):
        if purpose == "--format hf":
            raise DDiLoCoError(
                f"--format hf needs a Hugging Face model (one with save_pretrained); {what} and has none: use "
                "--format safetensors"
            )
        raise DDiLoCoError(f"{purpose} needs the run's model: {what}, and ddiloco cannot rebuild it: {in_python}")
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        # Only a torch module class is ever called (model.json comes with a folder, maybe another's).
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"{module}.{qualname} is not a torch.nn.Module class")
        model = cls(cls.config_class.from_dict(hf_config))
    except Exception as e:  # an import, a missing attribute, a config the class refuses: one line
        raise DDiLoCoError(
            f"{purpose} rebuilds {what} from its Hugging Face config in {run_dir / 'model.json'}, but could not "
            f"({type(e).__name__}: {e}): install its package, or {in_python}"
        ) from None
    return model
