"""What the soak's runs share (bench/soak.py, its insider phase bench/soak_insider.py and their
helper processes bench/soak_roles.py): the fleet's settings, who is honest, who attacks, the
attacks' names. A module of its own, so that the benches import it and not each other."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness.paths  # noqa: E402,F401  (puts src/ on sys.path)

HONEST = (0, 1, 2)
ATTACKER = 3
STRANGER_ID = 7  # an id nobody holds: the intruder claims it (and the real ones)
SETTINGS = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.options={batchnorm=true}",  # a model with buffers: the hostile-buffer attacks need them
    "run.num_learners=4",  # the same data shards in the baseline (learner 3 is then absent)
    "run.processed_tokens=1000000000",  # no end in sight: the run is as long as --minutes
    "runtime.duration_s=86400",  # (the syncer would end the run at its time budget otherwise)
    "inner.warmup_frac=0",  # (5% of 1e9 tokens would keep the LR warming up through the whole soak)
    "run.seed=0",
    "algo.sync_every=16",
    "runtime.step_sleep_s=0.05",
    "runtime.status_interval_s=0.5",
    "runtime.heartbeat_interval_s=0.25",
    "runtime.snapshot_interval_s=10",
    "runtime.backoff_max_s=1.0",
    "runtime.join_timeout_s=5.0",
]
ATTACKS = (
    "nan",
    "norm_100x",
    "inflated_counters",
    "replay",
    "wrong_shape",
    "buffer_nan",  # a NaN running mean
    "buffer_negative_var",  # a negative running variance
    "buffer_count",  # num_batches_tracked beyond any plausible count
    "buffer_shape",  # a running statistic of another shape
)
BUFFER_ATTACKS = {  # what each hostile-buffer attack needs in the fragment it answers for
    "buffer_nan": "running_mean",
    "buffer_negative_var": "running_var",
    "buffer_count": "num_batches_tracked",
    "buffer_shape": "running_mean",
}
OVERSIZED_CUT = 0.1
"""A 100x-norm attack may be merged only cut to at most this fraction of its size (the robust
merge clips to 3x the round's median |delta| per step: about 0.03 of a 100x answer)."""
LEARNER_RESTART_S = 2.0
SYNCER_RESTART_S = 0.5


def load_cfg(extra: list[str] | None = None) -> Any:
    """The soak's config (``extra``: more overrides, e.g. the insider phase's seed)."""
    from ddiloco.config import load_config

    return load_config(None, [*SETTINGS, *(extra or [])])
