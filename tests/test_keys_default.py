"""Keys by default, also on loopback: ``ddiloco train`` and ``ddiloco.SyncerServer`` make the
run's CURVE keys in RUN_DIR/keys (folder 0700, secrets 0600, never overwritten) and use them, so
that a local process without them gets no answer; ``--insecure`` / ``insecure=True`` turn that
off. A resumed run whose syncer state is gone is refused in one line; ``--start-over`` starts it
over."""

from __future__ import annotations

import json
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ddiloco
from ddiloco.cli import main
from ddiloco.config import load_config
from ddiloco.errors import DDiLoCoError
from ddiloco.service.base.keys import ClientKeys, forget_local_keys, local_keys, remember_local_keys, run_keys
from ddiloco.service.base.observer import NoReply, fetch_status
from ddiloco.service.ops.launcher import Launcher

torch.set_num_threads(1)

SYNTHETIC = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.options={hidden = 8}"]


def test_run_keys_are_private_made_once_and_cheap(tmp_path):
    t0 = time.perf_counter()
    d = run_keys(tmp_path / "run", 8)
    made_s = time.perf_counter() - t0
    assert d == tmp_path / "run" / "keys" and stat.S_IMODE(d.stat().st_mode) == 0o700
    secrets = sorted(p.name for p in d.glob("*.key_secret"))
    assert secrets == sorted(
        ["syncer.key_secret", "observer.key_secret", *(f"learner-{m}.key_secret" for m in range(8))]
    )
    assert all(stat.S_IMODE((d / s).stat().st_mode) == 0o600 for s in secrets)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    run_keys(tmp_path / "run", 10)  # a resumed run with more learners: the old pairs are kept
    after = {p.name: p.read_bytes() for p in d.iterdir()}
    assert all(after[name] == data for name, data in before.items()) and "learner-9.key_secret" in after
    assert made_s < 30  # milliseconds in practice (see the report); bounded loosely: a busy machine passes


def launcher(run_dir: Path, **kw) -> Launcher:
    cfg = load_config(None, SYNTHETIC + ["run.num_learners=2"])
    return Launcher(cfg, run_dir, **kw)


def test_train_gives_every_child_the_runs_keys_unless_insecure(tmp_path):
    keyed = launcher(tmp_path / "keyed")
    assert keyed.keys == tmp_path / "keyed" / "keys"
    for p in (keyed.syncer, *keyed.learners, keyed.evaluator):
        i = p.argv.index("--keys")
        assert p.argv[i + 1] == str(keyed.keys) and "--insecure" not in p.argv, p.name
    ClientKeys.load(keyed.keys, "learner-1")  # each learner's secret is there
    plain = launcher(tmp_path / "plain", insecure=True)
    assert plain.keys is None and not (tmp_path / "plain" / "keys").exists()
    assert all("--insecure" in p.argv and "--keys" not in p.argv for p in (plain.syncer, *plain.learners))


def test_a_resumed_launch_gives_its_processes_the_runtime_settings_it_was_given(tmp_path):
    """`ddiloco train --resume RUN_DIR --set runtime.X=...`: the syncer, learners and evaluator
    get the new runtime settings (they were handed the saved config.toml, and ignored them); the
    saved config keeps the run's own, and each process still checks the two agree."""
    from ddiloco.config import load_config

    first = launcher(tmp_path / "r")
    saved = (tmp_path / "r" / "config.toml").read_text()
    assert load_config(first.cfg_path).runtime.end_linger_s != 7.5
    resumed = load_config(tmp_path / "r" / "config.toml", ["runtime.end_linger_s=7.5", "run.threads=2"])
    again = Launcher(resumed, tmp_path / "r")
    assert (tmp_path / "r" / "config.toml").read_text() == saved  # the run's own, unchanged
    given = load_config(again.cfg_path)
    assert given.runtime.end_linger_s == 7.5 and given.run.threads == 2
    for p in (again.syncer, *again.learners, again.evaluator):
        assert p.argv[-1] == str(again.cfg_path), p.name


def a_run_whose_state_was_deleted(run_dir: Path) -> None:
    launcher(run_dir)  # run.json, config.toml, keys
    (run_dir / "metrics" / "run.jsonl").write_text('{"event": "run", "time": 0.0, "what": "start", "reason": ""}\n')
    (run_dir / "state").mkdir(exist_ok=True)  # ... whose contents are gone
    shutil.rmtree(run_dir / "state")


def test_train_resume_of_a_run_whose_state_is_gone_is_refused_and_start_over_starts_over(tmp_path):
    run = tmp_path / "run"
    a_run_whose_state_was_deleted(run)
    with pytest.raises(DDiLoCoError, match="syncer state .* is missing or empty.*--start-over") as e:
        launcher(run)
    assert "\n" not in str(e.value)
    launcher(run, start_over=True)
    runlog = [json.loads(line) for line in (run / "metrics" / "run.jsonl").read_text().splitlines()]
    assert runlog[-1]["what"] == "start_over" and (run / "state" / "FORMAT").is_file()
    launcher(run)  # from now on it resumes without the flag


def test_the_cli_refuses_a_start_over_without_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--start-over"]) == 2
    assert "--start-over starts a run over whose syncer state is gone: use it with --resume" in capsys.readouterr().err


def test_the_cli_syncer_refuses_a_run_folder_without_state_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    a_run_whose_state_was_deleted(run)
    argv = ["syncer", str(run / "config.toml"), "--bind", "tcp://127.0.0.1:*", "--run-dir", str(run), "--insecure"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is missing or empty" in err[0] and "--start-over" in err[0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_library_syncer_is_keyed_on_loopback_and_its_process_finds_the_keys(tmp_path, capsys):
    cfg = load_config(None, ["runtime.status_interval_s=0.2"])
    server = ddiloco.SyncerServer(Net(), "tcp://127.0.0.1:*", tmp_path, config=cfg, fsync=False).start()
    try:
        assert server.keys == tmp_path / "keys" and local_keys([server.address]) == server.keys
        # a local process without the keys (no registry in its process, as if forgotten here):
        # nothing is answered
        forget_local_keys(server.address)
        try:
            with pytest.raises(NoReply):
                fetch_status(server.address, 0.5)
        finally:
            remember_local_keys(server.address, server.keys)
        # the observer's key gets an answer; so does a keyless fetch or `ddiloco status` in this process
        assert fetch_status(server.address, 5.0, ClientKeys.load(server.keys, "observer"))["shard"] == 0
        assert fetch_status(server.address, 5.0)["shard"] == 0
        assert main(["status", server.address, "--json", "--timeout", "5"]) == 0
        assert json.loads(capsys.readouterr().out)["shard"] == 0
        # ... and with the run folder given as the keys
        assert main(["status", server.address, "--json", "--keys", str(tmp_path)]) == 0
    finally:
        server.stop()
    assert local_keys([server.address]) is None


def test_a_library_syncer_told_insecure_makes_no_keys(tmp_path):
    cfg = load_config(None, [])
    with ddiloco.SyncerServer(Net(), "tcp://127.0.0.1:*", tmp_path, config=cfg, fsync=False, insecure=True) as s:
        assert s.keys is None and not (tmp_path / "keys").exists() and local_keys([s.address]) is None
