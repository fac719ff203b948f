"""Exporting the global model: a plain state dict (safetensors) and, for Hugging Face models, a
folder that ``from_pretrained`` loads.

The syncer writes ``RUN_DIR/final/model.safetensors`` when it stops (``save_pieces``: a tied
tensor once, its other names as aliases that ``load_state_dict`` lists again); a live syncer's
current model can be fetched instead (``fetch_state``). ``export_model`` loads
either into the user's model and writes the folder; ``ddiloco export`` calls the same functions.

The file itself (``save_state_dict``, ``load_state_dict``, ``FINAL``) is the run folder's, in
``ddiloco.report.model_file``: the syncer writes it without importing this module, which
imports the syncer's client side (``fetch_state``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ddiloco.errors import DDiLoCoError
from ddiloco.report.model_file import FINAL, load_state_dict, save_state_dict, view_key

__all__ = ["FINAL", "export_model", "fetch_state", "load_state_dict", "save_state_dict"]

log = logging.getLogger(__name__)


def fetch_state(
    model: nn.Module,
    syncers: Sequence[str],
    num_fragments: int | str = "auto",
    config: object = None,
    key: str | Path | None = None,
    timeout_s: float = 10.0,
    insecure: bool = False,
) -> dict[str, torch.Tensor]:
    """The current global model of a live syncer (every shard), as a state dict of ``model``'s
    structure. ``config`` must give the syncer's fragment layout (a Config, DiLoCoConfig or TOML).
    ``insecure`` allows a syncer off this machine without keys (it is said once). Tied keys
    share one copy (as in the model), so ``save_state_dict`` writes it once."""
    from ddiloco.config import as_config
    from ddiloco.service.base.observer import fetch_global, observer_keys, write_global_states
    from ddiloco.training.layout import layout_of

    cfg = as_config(config)  # type: ignore[arg-type]
    keys = observer_keys(list(syncers), key, insecure)
    states = fetch_global(list(syncers), timeout_s, keys, requester="ddiloco export")  # NoReply says why not
    # the fragments alone: which tensors are embedding-like (merged by mean) does not move them
    layout = layout_of(model, cfg.algo, lambda _: False).fragments
    write_global_states(model, layout, states)
    out: dict[str, torch.Tensor] = {}
    copies: dict[tuple[object, ...], torch.Tensor] = {}  # one copy per tensor: tied keys share it
    for k, v in model.state_dict().items():
        view = view_key(v)
        if view is not None and view in copies:
            out[k] = copies[view]
            continue
        out[k] = v.detach().clone()
        if view is not None:
            copies[view] = out[k]
    return out


def export_model(model: nn.Module, state: Mapping[str, torch.Tensor] | str | Path, out_dir: str | Path) -> Path:
    """Load ``state`` (a state dict, a safetensors file or a run folder) into ``model`` and write
    ``out_dir``: ``model.safetensors`` (plain state dict) and, for a Hugging Face model
    (one with ``save_pretrained``), its config and weights, loadable with ``from_pretrained``."""
    sd = load_state_dict(state) if isinstance(state, (str, Path)) else dict(state)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected:
        raise DDiLoCoError(
            f"the exported state has tensors this model lacks ({', '.join(unexpected[:3])}): build the model the "
            "run trained"
        )
    # A state may list a tied tensor once (a user's dict, a file another tool wrote without
    # aliases): its other names are filled through the tie. Anything else missing is an error.
    tied = {n for n in missing if _is_tied(model, n)}
    if set(missing) - tied:
        raise DDiLoCoError(f"the exported state lacks {', '.join(sorted(set(missing) - tied)[:3])}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        save_pretrained(str(out))  # writes its own model.safetensors (tied weights once) and config.json
    else:
        save_state_dict(model.state_dict(), out / "model.safetensors")
    log.info("exported the global model to %s", out)
    return out


def _is_tied(model: nn.Module, name: str) -> bool:
    """Whether state-dict entry ``name`` shares its memory with a parameter under another name."""
    sd = model.state_dict(keep_vars=True)
    t = sd.get(name)
    if t is None:
        return False
    return any(other is not name and v.data_ptr() == t.data_ptr() for other, v in sd.items() if other != name)
