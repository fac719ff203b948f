"""The command line: --version, help for every argument, `ddiloco config`, --set precedence,
warnings, parse-time argument checks, run-folder choice and checks, `ddiloco export`."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import warnings
from pathlib import Path

import pytest

import ddiloco
from ddiloco.cli import build_parser, main
from ddiloco.errors import DDiLoCoError

SYNTH = [
    "--set",
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "--set",
    "workload.batch_size=16",
    "--set",
    "run.processed_tokens=4000",
    "--set",
    "run.eval_points=2",
    "--set",
    "chaos.restart_s=0.5",
]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


class Stop(DDiLoCoError):
    """Raised by the stand-ins below once they have what the test needs."""


# -- 1. version, 2. help ------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ddiloco {ddiloco.__version__}"
    assert ddiloco.__version__.count(".") == 2


def test_every_argument_of_every_command_has_help():
    subs = _subparsers(build_parser())
    assert {"simulate", "syncer", "learner", "evaluator", "keys", "train", "config", "export", "goodput"} <= set(subs)
    missing = [
        f"{name} {a.option_strings or a.dest}"
        for name, p in subs.items()
        for a in p._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert missing == []
    for name in ("simulate", "syncer", "learner", "evaluator", "train", "config"):
        dests = {a.dest for a in subs[name]._actions}
        assert {"config", "method", "set"} <= dests, name


# -- 3. config reference ------------------------------------------------------------------------


def test_every_config_field_has_a_docstring():
    from ddiloco.config import SECTIONS, Config
    from ddiloco.config_reference import missing_docs

    undocumented = {sec: missing_docs(cls) for sec, cls in {**SECTIONS, "(Config)": Config}.items()}
    assert undocumented == {sec: [] for sec in undocumented}


def test_the_docstring_check_catches_a_missing_one():
    from ddiloco.config_reference import field_docs, missing_docs

    @dataclasses.dataclass(frozen=True)
    class Small:
        documented: int = 1
        """It has one."""
        bare: float = 2.0
        empty: str = ""
        """ """
        last: bool = False

    assert missing_docs(Small) == ["bare", "empty", "last"]
    assert field_docs(Small) == {"documented": "It has one.", "empty": ""}


def test_config_list_prints_every_key_with_type_default_and_docs(capsys):
    from ddiloco.config import SECTIONS

    assert main(["config", "--list"]) == 0
    out = capsys.readouterr().out
    for sec, cls in SECTIONS.items():
        assert f"[{sec}]" in out
        for f in dataclasses.fields(cls):
            assert f"\n{sec}.{f.name} (" in out, f"{sec}.{f.name}"
    assert 'run.method ("dp" | "diloco" | "streaming" | "decoupled") = "decoupled"\n' in out
    assert 'algo.quorum (int | "all") = 1\n    K: distinct learners' in out
    assert 'algo.num_fragments (int | "auto") = "auto"\n' in out
    assert "workload.options (dict[str, Any]) = {}\n" in out
    assert "chaos.stragglers (tuple[str, ...]) = []" in out
    assert "runtime.duration_s (float) = inf\n    A real run's time budget" in out


def test_config_list_with_a_method_shows_its_preset(capsys):
    assert main(["config", "--list", "--method", "streaming"]) == 0
    out = capsys.readouterr().out
    assert 'algo.merge ("rda" | "mean") = "mean"   (method preset)' in out
    assert "algo.alpha (float) = 0.5   (method preset)" in out
    assert "algo.sync_every (int) = 24\n" in out  # not touched by the preset


def test_config_prints_the_resolved_toml(tmp_path, capsys):
    from ddiloco.config import load_config, tomllib

    f = tmp_path / "c.toml"
    f.write_text("[run]\nmethod = 'diloco'\nnum_learners = 3\n")
    assert main(["config", str(f), "--set", "algo.overlap=0", "--set", "sim.speeds=[1,2,3]"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["run"]["num_learners"] == 3 and data["algo"]["quorum"] == "all"  # the diloco preset under it
    assert data["sim"]["speeds"] == [1.0, 2.0, 3.0]
    import tomli_w

    out = tmp_path / "out.toml"  # the printed text loads back to the same config
    out.write_text(tomli_w.dumps(data))
    from ddiloco.methods import PRESETS

    assert load_config(out) == load_config(f, ["algo.overlap=0", "sim.speeds=[1,2,3]"], base=PRESETS["diloco"])


# -- 4. --set precedence ------------------------------------------------------------------------


def _capture(monkeypatch, target: str, attr: str) -> dict:
    import importlib

    seen: dict = {}

    def fake(cfg, *a, **k):
        seen["cfg"] = cfg
        seen["args"] = a
        seen["kwargs"] = k
        raise Stop("stopped by the test")

    monkeypatch.setattr(importlib.import_module(target), attr, fake)
    return seen


@pytest.mark.parametrize("command", ["simulate", "syncer", "learner", "evaluator", "train"])
def test_set_run_method_wins_over_method(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fake = {
        "simulate": ("ddiloco.sim.run", "simulate"),
        "syncer": ("ddiloco.service.syncer.service", "open_syncer"),
        "learner": ("ddiloco.service.learner.process", "run_learner"),
        "evaluator": ("ddiloco.service.ops.evaluator", "run_evaluator"),
        "train": ("ddiloco.service.ops.launcher", "Launcher"),
    }[command]
    seen = _capture(monkeypatch, *fake)

    def extra(run_dir: str) -> list[str]:
        return {
            "simulate": [],
            "syncer": ["--bind", "tcp://127.0.0.1:5555", "--run-dir", run_dir],
            "learner": ["--syncer", "tcp://127.0.0.1:5555", "--id", "0", "--run-dir", run_dir],
            "evaluator": ["--syncer", "tcp://127.0.0.1:5555", "--run-dir", run_dir],
            "train": [],
        }[command]

    f = tmp_path / "c.toml"
    f.write_text("[run]\nmethod = 'decoupled'\n[algo]\nsync_every = 12\n")
    argv = [
        command,
        str(f),
        "--method",
        "diloco",
        "--set",
        "run.method=streaming",
        "--set",
        "algo.overlap=1",
        *extra("r1"),
    ]
    assert main(argv) == 2
    assert "stopped by the test" in capsys.readouterr().err
    cfg = seen["cfg"]
    assert cfg.run.method == "streaming"
    assert cfg.algo.alpha == 0.5 and cfg.algo.late_fragment == "wait"  # the streaming preset is the base
    assert cfg.algo.sync_every == 12 and cfg.algo.overlap == 1  # the file, then --set, over it
    # --method still beats the file
    seen.clear()
    assert main([command, str(f), "--method", "diloco", *extra("r2")]) == 2
    assert seen["cfg"].run.method == "diloco" and seen["cfg"].algo.num_fragments == 1


# -- 5. warnings ------------------------------------------------------------------------------


def test_ddiloco_warnings_show_once_and_others_keep_their_filters(capsys):
    from ddiloco.cli import ddiloco_warnings

    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("ignore", DeprecationWarning)  # as Python does outside __main__
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))  # the display in force
        with ddiloco_warnings():
            for _ in range(3):
                warnings.warn_explicit("ours, test_cli 1", UserWarning, ddiloco.__file__, 1, module="ddiloco.config")
            warnings.warn_explicit("theirs, test_cli 1", DeprecationWarning, "lib.py", 1, module="somelib")
        with ddiloco_warnings():
            warnings.warn_explicit("theirs, test_cli 2", UserWarning, "lib.py", 2, module="somelib", registry={})
    err = capsys.readouterr().err
    assert err.count("warning: ours, test_cli 1") == 1
    assert "theirs, test_cli 1" not in err  # the user's filters are left alone (no "always")
    assert shown == ["theirs, test_cli 2"]  # others go to the display in force, in its own format


# -- 6. parse-time checks ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["syncer", "--bind", "127.0.0.1:48911", "--run-dir", "r"], "use tcp://127.0.0.1:48911"),
        (["syncer", "--bind", "tcp://0.0.0.0:0", "--run-dir", "r"], "port '0' is out of range; allowed: 1 .. 65535"),
        (["syncer", "--bind", "tcp://host:70000", "--run-dir", "r"], "out of range"),
        (["syncer", "--bind", "tcp://host", "--run-dir", "r"], "is not a ZeroMQ address; use tcp://HOST:PORT"),
        (["syncer", "--bind", "udp://h:1", "--run-dir", "r"], "is not a ZeroMQ address"),
        (["syncer", "--bind", "ipc://", "--run-dir", "r"], "names no path"),
        (["syncer", "--bind", "tcp://*:1", "--run-dir", "r", "--shard", "-1"], "-1 is out of range; allowed: >= 0"),
        (["syncer", "--bind", "tcp://*:1", "--run-dir", "r", "--num-shards", "0"], "allowed: >= 1"),
        (["syncer", "--bind", "tcp://*:1", "--run-dir", "r", "--shard", "2", "--num-shards", "2"], "--shard 2"),
        (["learner", "--syncer", "localhost:5555", "--id", "0"], "use tcp://localhost:5555"),
        (["learner", "--syncer", "tcp://*:5555", "--id", "0"], "connect to a host"),
        (["learner", "--syncer", "tcp://h:1", "--id", "-1"], "allowed: 0 .. 65535"),
        (["learner", "--syncer", "tcp://h:1", "--id", "65536"], "allowed: 0 .. 65535"),
        (["learner", "--syncer", "tcp://h:1", "--id", "x"], "'x' is not an integer"),
        (["learner", "--syncer", "tcp://h:1", "--id", "0", "--threads", "-2"], "allowed: >= 0"),
        (["evaluator", "--syncer", "h:1", "--run-dir", "r"], "use tcp://h:1"),
        (["simulate", "--set", "algo.quorum"], "must look like SECTION.KEY=VALUE"),
        (["simulate", "--set", "quorum=2"], "must look like SECTION.KEY=VALUE"),
        (["train", "--port", "0"], "allowed: 1 .. 65535"),
        (["keys", "k", "--learners", "0"], "allowed: 1 .. 65536"),
    ],
)
def test_bad_arguments_are_refused_at_parse_time(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.strip().splitlines()[-1].startswith(f"ddiloco {argv[0]}: error: ")


@pytest.mark.parametrize(
    "flag,address",
    [
        ("--bind", "tcp://*:5555"),
        ("--bind", "tcp://0.0.0.0:5555"),
        ("--bind", "tcp://127.0.0.1:*"),
        ("--bind", "tcp://[::1]:5555"),
        ("--bind", "ipc:///tmp/ddiloco.sock"),
        ("--syncer", "tcp://127.0.0.5:0;127.0.0.2:7"),  # the loopback source form the tests use
        ("--syncer", "tcp://syncer-0.example.org:65535"),
    ],
)
def test_good_addresses_pass(flag, address):
    argv = (
        ["syncer", "--bind", address, "--run-dir", "r"]
        if flag == "--bind"
        else ["learner", "--syncer", address, "--id", "3", "--set", "run.processed_tokens = 10"]
    )
    args = build_parser().parse_args(argv)
    assert (args.bind if flag == "--bind" else args.syncer) in (address, [address])


def test_train_takes_host_and_port():
    args = build_parser().parse_args(["train", "--host", "10.0.0.2", "--port", "48911"])
    assert (args.host, args.port) == ("10.0.0.2", 48911)
    args = build_parser().parse_args(["train"])
    assert (args.host, args.port) == ("127.0.0.1", None)


# -- 8. run folders ----------------------------------------------------------------------------


def test_fresh_run_folders_are_timestamped_and_latest_points_at_the_newest(tmp_path):
    from ddiloco.report.rundir import choose_run_dir

    now = dt.datetime(2026, 1, 2, 3, 4, 5)
    cfg_dir = tmp_path / "runs" / "latest"
    a, resuming = choose_run_dir(cfg_dir, "decoupled", None, None, now=now)
    assert (a, resuming) == (tmp_path / "runs" / "decoupled-20260102-030405", False) and a.is_dir()
    b, _ = choose_run_dir(cfg_dir, "decoupled", None, None, now=now)
    c, _ = choose_run_dir(cfg_dir, "decoupled", None, None, now=now)
    assert (b.name, c.name) == ("decoupled-20260102-030405-2", "decoupled-20260102-030405-3")
    assert os.readlink(cfg_dir) == c.name  # relative
    assert cfg_dir.resolve() == c.resolve()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [a.name, b.name, c.name, "latest"]


def test_latest_as_an_old_real_folder_is_kept_and_LATEST_names_the_run(tmp_path):
    from ddiloco.report.rundir import choose_run_dir

    (tmp_path / "latest").mkdir()
    with pytest.warns(UserWarning, match="is a folder"):
        d, _ = choose_run_dir(tmp_path / "latest", "diloco", None, None)
    assert (tmp_path / "LATEST").read_text().strip() == d.name and (tmp_path / "latest").is_dir()


def test_explicit_run_dirs_and_resume(tmp_path):
    from ddiloco.report.rundir import choose_run_dir, prepare_run_dir

    assert choose_run_dir("runs/latest", "decoupled", tmp_path / "mine", None) == (tmp_path / "mine", False)
    assert choose_run_dir(tmp_path / "exp1", "decoupled", None, None) == (tmp_path / "exp1", False)  # run.run_dir
    prepare_run_dir(tmp_path / "mine", "test")
    with pytest.raises(DDiLoCoError, match=f"already holds a run; continue it with --resume {tmp_path / 'mine'}"):
        choose_run_dir("runs/latest", "decoupled", tmp_path / "mine", None)
    assert choose_run_dir("runs/latest", "decoupled", None, tmp_path / "mine") == ((tmp_path / "mine").resolve(), True)
    with pytest.raises(DDiLoCoError, match="not both"):
        choose_run_dir("runs/latest", "decoupled", tmp_path / "a", tmp_path / "mine")
    with pytest.raises(DDiLoCoError, match="no run folder there"):
        choose_run_dir("runs/latest", "decoupled", None, tmp_path / "missing")


def test_resume_of_a_missing_folder_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "runs/nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --resume runs/nope: no run folder there; pass a folder an earlier run wrote (it has run.json)"
    ]
    assert not (tmp_path / "runs").exists()


def test_resume_loads_the_saved_config_and_allows_only_runtime_overrides(tmp_path, monkeypatch, capsys):
    from ddiloco.config import load_config
    from ddiloco.report.rundir import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    saved = load_config(None, ["run.method=diloco", "algo.sync_every=7"])
    prepare_run_dir(tmp_path / "r", "test", saved)
    seen = _capture(monkeypatch, "ddiloco.service.ops.launcher", "Launcher")
    assert main(["train", "--resume", "r", "--set", "runtime.duration_s=5", "--set", "run.threads=2"]) == 2
    assert seen["cfg"].algo.sync_every == 7 and seen["cfg"].run.method == "diloco"
    assert seen["cfg"].runtime.duration_s == 5 and seen["args"][0] == (tmp_path / "r").resolve()
    capsys.readouterr()
    assert main(["train", "--resume", "r", "--set", "algo.sync_every=8"]) == 2
    assert "only runtime.* and run.threads" in capsys.readouterr().err
    assert main(["train", "--resume", "r", "--method", "diloco"]) == 2
    assert "drop --method" in capsys.readouterr().err
    assert main(["train", "--run-dir", "r"]) == 2  # a new run in an existing run's folder
    assert "already holds a run; continue it with --resume r" in capsys.readouterr().err


def test_a_different_saved_config_is_refused_and_left_unchanged(tmp_path):
    from ddiloco.config import load_config
    from ddiloco.report.rundir import prepare_run_dir

    d = tmp_path / "r"
    prepare_run_dir(d, "test", load_config(None, ["algo.quorum=2", "runtime.duration_s=10"]))
    run = json.loads((d / "run.json").read_text())
    assert run["format"] == 2 and run["by"] == "test" and abs(run["started_at"] - __import__("time").time()) < 60
    before = (d / "config.toml").read_text()
    # runtime.*, run.threads and run.run_dir may differ
    prepare_run_dir(d, "again", load_config(None, ["algo.quorum=2", "runtime.duration_s=99", "run.threads=3"]))
    with pytest.raises(DDiLoCoError) as e:
        prepare_run_dir(d, "again", load_config(None, ["algo.quorum=3", "inner.lr=0.01"]))
    assert str(e.value).startswith(
        f"run folder {d} was made with algo.quorum = 2, but this command has algo.quorum = 3"
    )
    assert "\n" not in str(e.value)
    assert (d / "config.toml").read_text() == before
    assert sorted(p.name for p in d.iterdir()) == ["config.toml", "run.json"]


def test_a_format_1_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from ddiloco.config import Config
    from ddiloco.report.rundir import prepare_run_dir

    d = tmp_path / "old"
    d.mkdir()
    (d / "run.json").write_text('{"format": 1, "created": "2025-01-01T00:00:00+00:00", "by": "ddiloco train"}')
    (d / "metrics.jsonl").write_text("")
    with pytest.raises(
        DDiLoCoError, match="is of format 1, this ddiloco writes format 2: migrate it in place with `ddi"
    ):
        prepare_run_dir(d, "test", Config())
    monkeypatch.chdir(tmp_path)
    seen = _capture(monkeypatch, "ddiloco.service.syncer.service", "open_syncer")
    assert main(["syncer", "--bind", "tcp://127.0.0.1:5555", "--run-dir", "old"]) == 2
    assert "format 1" in capsys.readouterr().err and not seen
    assert sorted(p.name for p in d.iterdir()) == ["metrics.jsonl", "run.json"]


def test_the_syncer_resumes_its_run_folder_without_a_flag_if_the_config_matches(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    seen = _capture(monkeypatch, "ddiloco.service.syncer.service", "open_syncer")
    argv = ["syncer", "--bind", "tcp://127.0.0.1:5555", "--run-dir", "r", "--set", "algo.sync_every=6"]
    assert main(argv) == 2 and seen["cfg"].algo.sync_every == 6
    assert (tmp_path / "r" / "config.toml").is_file()  # the first command on a folder saves its config
    seen.clear()
    assert main([*argv, "--set", "runtime.snapshot_interval_s=3"]) == 2 and seen  # a restart: fine
    seen.clear()
    assert main([*argv[:-1], "algo.sync_every=8"]) == 2 and not seen
    assert "was made with algo.sync_every = 6, but this command has algo.sync_every = 8" in capsys.readouterr().err


# -- 8 + 9. a real simulate, then export ---------------------------------------------------------


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> Path:
    """One quick simulate in a fresh runs/ folder (shared by the export tests)."""
    root = tmp_path_factory.mktemp("sim")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["simulate", "--method", "decoupled", *SYNTH]) == 0
    finally:
        os.chdir(cwd)
    runs = root / "runs"
    (d,) = [p for p in runs.iterdir() if p.name.startswith("decoupled-")]
    assert os.readlink(runs / "latest") == d.name
    return d


def test_simulate_writes_a_fresh_format_2_folder(sim_run):
    from ddiloco.config import load_config

    run = json.loads((sim_run / "run.json").read_text())
    assert run["format"] == 2 and "started_at" in run and run["by"] == "ddiloco simulate"
    cfg = load_config(sim_run / "config.toml")
    assert cfg.run.run_dir == str(Path("runs") / sim_run.name) and cfg.run.processed_tokens == 4000
    assert (sim_run / "final" / "model.safetensors").is_file()


def test_export_a_run_folder_to_safetensors(sim_run, tmp_path, capsys):
    from safetensors.torch import load_file

    from ddiloco.config import load_config
    from ddiloco.workloads.config import load_workload

    out = tmp_path / "m.safetensors"
    assert main(["export", str(sim_run), "-o", str(out)]) == 0
    assert f"exported the global model to {out}" in capsys.readouterr().out
    state = load_file(str(out))
    final = load_file(str(sim_run / "final" / "model.safetensors"))
    assert state.keys() == final.keys() and all((state[k] == final[k]).all() for k in state)
    cfg = load_config(sim_run / "config.toml")
    load_workload(cfg.workload).build_model(0).load_state_dict(state)  # loads back into the model


def test_export_merges_shard_files(sim_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from ddiloco.export_cmd import final_state

    full = load_file(str(sim_run / "final" / "model.safetensors"))
    names = sorted(full)
    d = tmp_path / "sharded"
    (d / "final").mkdir(parents=True)
    for k in range(3):
        save_file({n: full[n] for n in names[k::3]}, str(d / "final" / f"model.shard-{k}.safetensors"))
    merged = final_state(d)
    assert merged.keys() == full.keys() and all((merged[k] == full[k]).all() for k in full)
    out = tmp_path / "merged.safetensors"
    assert main(["export", str(d), "-o", str(out)]) == 0
    assert load_file(str(out)).keys() == full.keys()


def test_export_errors_are_one_line(sim_run, tmp_path, capsys):
    assert main(["export", str(sim_run), "--format", "hf", "-o", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a Hugging Face model" in err[0] and "use --format safetensors" in err[0]
    assert main(["export", str(tmp_path)]) == 2
    assert "holds no final model" in capsys.readouterr().err
    assert main(["export", "tcp://127.0.0.1:5555"]) == 2
    assert "pass --config FILE or --run-dir RUN_DIR" in capsys.readouterr().err


def test_export_from_a_live_syncer_uses_the_run_config(sim_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import ddiloco.export_cmd as ec

    seen = {}

    def fake_fetch(model, syncers, config=None, key=None, timeout_s=10.0, insecure=False):
        seen.update(syncers=syncers, config=config, key=key, insecure=insecure)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    monkeypatch.setattr(ec, "fetch_state", fake_fetch)
    out = tmp_path / "live.safetensors"
    argv = ["export", "tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555", "--run-dir", str(sim_run), "-o", str(out)]
    assert main([*argv, "--insecure"]) == 0
    assert seen["syncers"] == ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"] and seen["insecure"]
    assert seen["config"].run.processed_tokens == 4000
    assert load_file(str(out)).keys() == load_file(str(sim_run / "final" / "model.safetensors")).keys()


def test_export_hf_writes_a_from_pretrained_folder(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import torch

    import ddiloco.export_cmd as ec
    from ddiloco.config import Config
    from ddiloco.export import save_state_dict
    from ddiloco.report.rundir import prepare_run_dir

    def tiny(seed: int):
        torch.manual_seed(seed)
        config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
        return transformers.GPT2LMHeadModel(config)

    trained = tiny(1)
    run = prepare_run_dir(tmp_path / "run", "test", Config())
    save_state_dict(trained.state_dict(), run / "final" / "model.safetensors")
    monkeypatch.setattr(ec, "_model", lambda cfg: tiny(2))  # the run's workload builds this HF model
    assert main(["export", str(run), "--format", "hf", "-o", str(tmp_path / "hf")]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    for name, t in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_a_learner_checks_an_existing_run_folder_but_makes_none(tmp_path, monkeypatch, capsys):
    from ddiloco.config import load_config
    from ddiloco.report.rundir import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    prepare_run_dir(tmp_path / "run", "test", load_config(None, ["algo.sync_every=6"]))
    seen = _capture(monkeypatch, "ddiloco.service.learner.process", "run_learner")
    argv = ["learner", "--syncer", "tcp://127.0.0.1:5555", "--id", "1", "--device", "cpu"]
    assert main([*argv, "--run-dir", "run"]) == 2 and not seen
    assert "was made with algo.sync_every = 6, but this command has algo.sync_every = 24" in capsys.readouterr().err
    assert main([*argv, "--run-dir", "run", "--set", "algo.sync_every=6"]) == 2 and seen  # matches: runs
    assert main([*argv, "--run-dir", "status-only"]) == 2
    assert not (tmp_path / "status-only").exists()  # the learner's own status folder is not made a run folder


def test_train_passes_host_and_port_to_the_launcher(tmp_path, monkeypatch):
    import ddiloco.service.ops.launcher as launcher

    monkeypatch.chdir(tmp_path)
    seen: dict = {}

    class Recording:
        def __init__(self, cfg, run_dir, host="127.0.0.1", on_status=None, port=None, insecure=False, start_over=False):
            seen.update(run_dir=run_dir, host=host, port=port, insecure=insecure, start_over=start_over)
            raise Stop("stopped by the test")

    monkeypatch.setattr(launcher, "Launcher", Recording)
    assert main(["train", "--host", "127.0.0.3", "--port", "48911"]) == 2
    assert (seen["host"], seen["port"]) == ("127.0.0.3", 48911)
    assert (seen["insecure"], seen["start_over"]) == (False, False)  # keys by default
    assert seen["run_dir"].parent == Path("runs") and seen["run_dir"].name.startswith("decoupled-")


def test_simulates_table_and_report_say_what_summary_json_says(tmp_path, monkeypatch, capsys):
    """`make simulate`'s screen and the report, read top to bottom, give summary.json's figures
    (issue 35: one number per fact), a straggler phase included."""
    from ddiloco.report.html import render_report
    from ddiloco.report.summary import SUMMARY_ROWS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")  # the table on one line per row
    chaos = ["--set", "chaos.enabled=true", "--set", 'chaos.stragglers=["1:2.0:0.1:0.5"]']
    assert main(["simulate", "--method", "decoupled", *SYNTH, *chaos]) == 0
    screen = capsys.readouterr().out
    (d,) = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("decoupled-")]
    summary = json.loads((d / "summary.json").read_text())
    shown = 0
    for label, key, fmt in SUMMARY_ROWS:
        value = summary.get(key)
        if isinstance(value, (int, float)) and fmt and key != "rejected":
            assert re.search(rf"{re.escape(fmt.format(value))}\s", screen), (label, fmt.format(value))
            shown += 1
    assert shown >= 12 and summary["straggler_phases"] == 1
    page = render_report([d], d / "report.html").read_text()
    for key, fmt in (("tokens_processed", "{:,.0f}"), ("goodput", "{:.1%}"), ("eval_loss", "{:.4f}")):
        assert fmt.format(summary[key]) in page, key
