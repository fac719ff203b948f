"""The run's settings a learner must agree with, which the syncer sends on join.

A learner registers with the settings it was given (``config=`` a ``Config`` or a TOML file;
``ddiloco learner``'s config file), and the syncer refuses it, naming the first that differs
and both values, when one is not the run's. A learner given no config asks the syncer for them
first and adopts them (``adopt``), so ``learner.cfg.run.processed_tokens`` is always the run's.
Given only a ``DiLoCoConfig``, it claims the ``algo.*`` settings and adopts the rest.

Which settings, and why (the rule itself is ``protocol.settings``):

| setting | why a learner must agree |
|---|---|
| ``run.processed_tokens`` | the run's budget; the LR schedule's horizon (``fleet_tokens / cfg.run.processed_tokens``) |
| ``run.merged_tokens`` | the run's second budget |
| ``run.num_learners`` | the cap on learner ids (0 .. M - 1) and the number of data shards |
| ``algo.num_fragments``, ``algo.fragment_strategy``, ``algo.sync_every`` | the fragment layout (and H, the schedule) |
| ``algo.overlap`` | tau: how long a fragment is in flight on the learner's schedule |
| ``algo.late_fragment`` | whether the learner waits for a late fragment (the lock-step baselines) |
| ``algo.alpha``, ``algo.on_merged`` | how a received fragment is applied (overwrite, blend, or shift) |
| ``algo.expert_weights`` | whether the learner counts and sends routed tokens per expert row |
| ``algo.keep_versions`` | how far ahead a merged version may be before the learner ignores it |
| ``algo.up_encoding``, ``algo.down_encoding``, ``algo.*_density``, ``algo.error_feedback`` | how payloads travel |

``ddiloco learner`` also trains with the run's seed (its data order) and inner optimizer, so it
claims ``INNER_LOOP`` too: ``run.seed`` and the ``inner.*`` LR schedule and AdamW settings. A
library learner uses its own optimizer and data: it adopts them (``learner.cfg.inner``) but is
not refused over them. ``runtime.*`` stays each process's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ddiloco.config import Config
from ddiloco.errors import ConfigError

EVERY_LEARNER = (
    "run.processed_tokens",
    "run.merged_tokens",
    "run.num_learners",
    "algo.num_fragments",
    "algo.fragment_strategy",
    "algo.sync_every",
    "algo.overlap",
    "algo.late_fragment",
    "algo.alpha",
    "algo.on_merged",
    "algo.expert_weights",
    "algo.keep_versions",
    "algo.up_encoding",
    "algo.down_encoding",
    "algo.up_density",
    "algo.down_density",
    "algo.error_feedback",
)
"""What every learner must agree with the syncer on (and claims, when it was given a config)."""
INNER_LOOP = (
    "run.seed",
    "inner.lr",
    "inner.warmup_frac",
    "inner.min_lr_frac",
    "inner.weight_decay",
    "inner.beta1",
    "inner.beta2",
    "inner.grad_clip",
)
"""What ``ddiloco learner``'s own training loop reads too (its data order and its AdamW schedule)."""
SETTINGS = EVERY_LEARNER + INNER_LOOP
"""Everything the syncer sends a learner on join, in the order a difference is looked for."""


def run_settings(cfg: Config, keys: Iterable[str] = SETTINGS) -> dict[str, Any]:
    """``cfg``'s values of ``keys`` ("section.key" -> value); what goes on the wire leaves out the
    newer ones at the value older peers behave as (``protocol.settings.said``)."""
    out: dict[str, Any] = {}
    for key in keys:
        section, name = key.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    return out


def adopt(cfg: Config, settings: Mapping[str, Any]) -> Config:
    """``cfg`` with the run's ``settings`` (as the syncer sent them), validated. A setting this
    ddiloco does not know is refused in one line (the syncer is of another version)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        part = getattr(cfg, section, None) if section in {f.name for f in dataclasses.fields(cfg)} else None
        if part is None or name not in {f.name for f in dataclasses.fields(part)}:
            raise ConfigError(f"the syncer sent a setting this ddiloco does not know: {key} (another version?)")
        sections.setdefault(section, {})[name] = value
    changed = {s: dataclasses.replace(getattr(cfg, s), **values) for s, values in sections.items()}
    return dataclasses.replace(cfg, **changed).validate()
