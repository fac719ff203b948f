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
    "Learner": "ddiloco.service.learner.api",
    "LearnerStats": "ddiloco.service.learner.stats",
    "SyncerServer": "ddiloco.service.syncer.api",
    "workload_from": "ddiloco.workloads.custom",
    "fleet_scheduler": "ddiloco.training.schedule",
    "lr_multiplier": "ddiloco.training.schedule",
    "recalibrate_batch_norm": "ddiloco.training.batch_norm",
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
__all__ = sorted(_EXPORTS)  # ddiloco.api lists the same names and a test checks they agree


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
