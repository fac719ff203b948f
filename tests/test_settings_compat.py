"""Settings newer than some peers of the same wire schema (``protocol.settings.UNSAID_AT``):
left unsaid at the value older peers behave as, so mixed versions meet when the run does not
use them and are refused in one line when it does."""

from __future__ import annotations

import dataclasses

import pytest

from ddiloco.config import Config
from ddiloco.errors import ConfigError
from ddiloco.protocol.settings import UNSAID_AT, first_difference, said
from ddiloco.settings import SETTINGS, adopt
from ddiloco.settings import run_settings as _all


def run_settings(cfg: Config) -> dict:
    """What goes on the wire (the service leaves out what is unsaid)."""
    return said(_all(cfg))


def _cfg(**algo: object) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, **algo))


def test_a_dense_run_says_nothing_of_density_and_a_sparse_one_does() -> None:
    dense = run_settings(_cfg())
    assert not set(UNSAID_AT) & set(dense) and set(dense) == set(SETTINGS) - set(UNSAID_AT)
    sparse = run_settings(_cfg(up_density=0.03))
    assert sparse["algo.up_density"] == 0.03 and "algo.down_density" not in sparse


def test_learners_and_syncers_of_either_version_agree_or_are_told_the_setting() -> None:
    old_learner = {k: v for k, v in run_settings(_cfg()).items() if k not in UNSAID_AT}
    assert first_difference(run_settings(_cfg()), old_learner) is None  # new syncer, dense run
    difference = first_difference(run_settings(_cfg(down_density=0.1)), old_learner)
    assert difference == "algo.down_density is 1.0 on this learner and 0.1 on the syncer"
    old_run = dict(old_learner)
    assert first_difference(old_run, run_settings(_cfg())) is None  # new learner, old syncer
    # (an older syncer's own rule says "unknown to the syncer"; this one names the values)
    difference = first_difference(old_run, run_settings(_cfg(up_density=0.01)))
    assert difference == "algo.up_density is 0.01 on this learner and 1.0 on the syncer"
    both = run_settings(_cfg(up_density=0.01, down_density=0.01))
    assert first_difference(both, both) is None
    assert "algo.up_density is 0.03" in str(first_difference(both, run_settings(_cfg(up_density=0.03))))


def test_an_adopting_learner_takes_density_from_the_run_and_keeps_its_default_otherwise() -> None:
    assert adopt(Config(), run_settings(_cfg(up_density=0.01))).algo.up_payload.endswith("+top41")
    assert adopt(Config(), run_settings(_cfg())).algo.up_density == 1.0
    with pytest.raises(ConfigError, match="algo.up_density"):
        adopt(Config(), {"algo.up_density": 0.0})
