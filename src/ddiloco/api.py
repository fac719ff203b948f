"""The public library API in one place, imported eagerly (``ddiloco.X`` is the same object,
imported on first use). See docs/library.md."""

from ddiloco.config import Config, load_config
from ddiloco.core.config import DiLoCoConfig
from ddiloco.errors import CommError, DDiLoCoError, RefusedError, UsageError
from ddiloco.export import export_model, fetch_state, load_state_dict, save_state_dict
from ddiloco.service.learner.api import Learner
from ddiloco.service.learner.stats import LearnerStats
from ddiloco.service.syncer.api import SyncerServer
from ddiloco.training.batch_norm import recalibrate_batch_norm
from ddiloco.training.schedule import fleet_scheduler, lr_multiplier
from ddiloco.workloads.custom import workload_from

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
    "fleet_scheduler",
    "load_config",
    "load_state_dict",
    "lr_multiplier",
    "recalibrate_batch_norm",
    "save_state_dict",
    "workload_from",
]
