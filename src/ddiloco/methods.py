"""The baselines as configurations of the same core (presets applied under the user's config)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Decoupled DiLoCo: the DiLoCoConfig defaults (P = model default, H = 24, tau = 2, K = 1,
    # grace on, overwrite, never wait).
    "decoupled": {"run": {"method": "decoupled"}},
    # Synchronous DiLoCo: one fragment, every live learner, no grace, lock-step, and the plain
    # (token-weighted) mean of the outer gradients, as in DiLoCo itself (RDA is an ablation).
    "diloco": {
        "run": {"method": "diloco"},
        "algo": {
            "merge": "mean",
            "num_fragments": 1,
            "quorum": "all",
            "grace": False,
            "late_fragment": "wait",
            "overlap": 0,
            "alpha": 0.0,
        },
    },
    # Streaming DiLoCo: staggered fragments with overlap, blend 0.5, every live learner, lock-step,
    # mean merge (as published).
    "streaming": {
        "run": {"method": "streaming"},
        "algo": {"merge": "mean", "quorum": "all", "grace": False, "late_fragment": "wait", "overlap": 2, "alpha": 0.5},
    },
    # Data-parallel: one model, gradients of M x B examples per step (the quality reference).
    "dp": {"run": {"method": "dp"}},
}
