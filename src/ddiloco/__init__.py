"""ddiloco: Decoupled DiLoCo for resilient, low-communication distributed pre-training.

The library API (``docs/library.md``)::

    learner = ddiloco.Learner(model, syncer="tcp://host:port", learner_id=3)
    ...  # your loop: forward, backward, optimizer.step()
    learner.step(tokens=n)

Names are imported on first use, so ``import ddiloco`` (and the command line) stays fast;
``ddiloco.api`` imports the same names eagerly, for type checkers and IDEs.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Learner": "ddiloco.service.api_learner",
    "LearnerStats": "ddiloco.service.api_learner",
    "SyncerServer": "ddiloco.service.api_syncer",
    "workload_from": "ddiloco.workloads.custom",
    "Config": "ddiloco.config",
    "load_config": "ddiloco.config",
    "DiLoCoConfig": "ddiloco.core.config",
    "save_state_dict": "ddiloco.export",
    "load_state_dict": "ddiloco.export",
    "export_model": "ddiloco.export",
    "fetch_state": "ddiloco.export",
    "DDiLoCoError": "ddiloco.errors",
    "UsageError": "ddiloco.errors",
    "RefusedError": "ddiloco.errors",
    "CommError": "ddiloco.errors",
}
__all__ = [
    "CommError",
    "Config",
    "DDiLoCoError",
    "DiLoCoConfig",
    "Learner",
    "LearnerStats",
    "RefusedError",
    "SyncerServer",
    "UsageError",
    "export_model",
    "fetch_state",
    "load_config",
    "load_state_dict",
    "save_state_dict",
    "workload_from",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
