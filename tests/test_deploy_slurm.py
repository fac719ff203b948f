"""deploy/slurm: the scripts are valid bash, and every command they would start parses with the
real parsers (ddiloco's, torchrun's). The jobs run in dry-run mode (DDILOCO_DRY_RUN=FILE writes
each command to FILE instead of starting it), with env.sh's defaults: no Slurm, no network, no
process of ddiloco started (except `ddiloco config` for submit.sh)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.cli import build_parser
from ddiloco.service.base.keys import make_keys

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "slurm"
SCRIPTS = sorted([*DEPLOY.rglob("*.sh"), *DEPLOY.rglob("*.sbatch")])
JOBS = ("syncer.sbatch", "learners.sbatch", "evaluator.sbatch")
ADDRESS = "tcp://node-7.cluster:5555"


def test_there_are_scripts_and_each_passes_bash_n():
    names = {p.name for p in SCRIPTS}
    assert {*JOBS, "env.sh", "lib.sh", "submit.sh", "split-keys.sh", "setup.sh"} <= names
    for script in SCRIPTS:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script}: {out.stderr}"


def sbatch_options(script: Path) -> list[str]:
    return [opt for line in script.read_text().splitlines() if line.startswith("#SBATCH") for opt in line.split()[1:]]


@pytest.mark.parametrize("job", JOBS)
def test_every_job_asks_to_be_requeued(job):
    assert "--requeue" in sbatch_options(DEPLOY / job)
    assert "--open-mode=append" in sbatch_options(DEPLOY / job)  # a requeued job's output is kept


def test_learners_name_only_their_own_key_folder():
    text = (DEPLOY / "learners.sbatch").read_text()
    uses = re.findall(r'"\$KEYS_DIR[^"]*"', text)
    assert uses == ['"$KEYS_DIR/learner-$ID"'], uses
    assert re.search(r'^ID="\$\{SLURM_ARRAY_TASK_ID:', text, re.M)


@pytest.fixture
def rig(tmp_path):
    """A keys folder split as split-keys.sh does, a run folder whose syncer wrote its address."""
    keys, run = tmp_path / "keys", tmp_path / "run"
    make_keys(keys, learners=2)
    env = clean_env(tmp_path)
    out = subprocess.run(["bash", str(DEPLOY / "split-keys.sh"), str(keys)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "syncer.address").write_text(ADDRESS + "\n")
    return tmp_path


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """No setting from the caller's environment: env.sh's defaults, but RUN_DIR and KEYS_DIR."""
    return {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp),
        "RUN_DIR": str(tmp / "run"),
        "KEYS_DIR": str(tmp / "keys"),
        "DDILOCO_ENV": str(DEPLOY / "env.sh"),
        "DDILOCO_DRY_RUN": str(tmp / "commands"),
        **extra,
    }


def dry_run(tmp: Path, script: str, **extra: str) -> list[list[str]]:
    (tmp / "commands").unlink(missing_ok=True)
    out = subprocess.run(["bash", str(DEPLOY / script)], env=clean_env(tmp, **extra), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in (tmp / "commands").read_text().splitlines()]


def ddiloco_args(argv: list[str]) -> list[str]:
    """The arguments after `ddiloco`, `python -m ddiloco`, or a torchrun's `-m ddiloco`."""
    if argv[0] == "ddiloco":
        return argv[1:]
    i = argv.index("-m")
    assert argv[i + 1] == "ddiloco", argv
    return argv[i + 2 :]


def parses(argv: list[str]):
    try:
        return build_parser().parse_args(ddiloco_args(argv))
    except SystemExit as e:  # argparse's error: the line is on stderr
        pytest.fail(f"does not parse ({e}): {shlex.join(argv)}")


def torchrun_parses(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    i = argv.index("torchrun")
    args = get_args_parser().parse_args(argv[i + 1 :])
    assert args.module and args.training_script == "ddiloco"


def test_the_syncer_and_evaluator_commands_parse(rig):
    (syncer,) = dry_run(rig, "syncer.sbatch")
    a = parses(syncer)
    assert (a.command, a.bind, a.run_dir, a.keys) == ("syncer", "tcp://0.0.0.0:5555", str(rig / "run"),
                                                      str(rig / "keys" / "syncer"))  # fmt: skip
    assert a.config == "/shared/ddiloco/exp1.toml"  # env.sh's default
    assert sorted(p.name for p in (rig / "keys" / "syncer").iterdir()) == [
        "learner-0.key", "learner-1.key", "observer.key", "syncer.key", "syncer.key_secret"]  # fmt: skip

    (evaluator,) = dry_run(rig, "evaluator.sbatch")
    a = parses(evaluator)
    assert (a.command, a.syncer, a.run_dir) == ("evaluator", [ADDRESS], str(rig / "run"))
    assert sorted(p.name for p in Path(a.keys).iterdir()) == ["observer.key_secret", "syncer.key"]


@pytest.mark.parametrize(
    ("settings", "launcher"),
    [
        ({}, "torchrun"),  # env.sh's default: 1 node of 8 GPUs, a torchrun group of 8
        ({"LEARNER_RANKS_PER_NODE": "1"}, "python"),  # one process, no torchrun
        ({"LEARNER_NODES": "2"}, "srun"),  # one torchrun per node
    ],
)
def test_each_learner_command_parses_and_reads_only_its_own_key(rig, settings, launcher):
    (learner,) = dry_run(rig, "learners.sbatch", SLURM_ARRAY_TASK_ID="1", SLURM_JOB_ID="41", **settings)
    assert learner[0] == launcher
    a = parses(learner)
    assert (a.command, a.id, a.syncer, a.run_dir) == ("learner", 1, [ADDRESS], str(rig / "run"))
    assert a.keys == str(rig / "keys" / "learner-1")
    assert sorted(p.name for p in Path(a.keys).iterdir()) == ["learner-1.key_secret", "syncer.key"]
    if launcher != "python":
        torchrun_parses(learner)
        assert learner[learner.index("--nproc-per-node") + 1] == "8"
    if launcher == "srun":
        assert learner[learner.index("--nnodes") + 1] == "2"


def test_a_pinned_syncer_address_is_used_as_it_is(rig):
    (rig / "run" / "slurm" / "syncer.address").unlink()  # no file needed, none waited for
    pinned = "tcp://syncer.example.org:6000"
    (learner,) = dry_run(rig, "learners.sbatch", SLURM_ARRAY_TASK_ID="0", SYNCER_ADDR=pinned)
    assert parses(learner).syncer == [pinned]


def test_the_test_rig_commands_parse(rig):
    """single-node/env.sh (2 CPU ranks per learner, the tiny config) over env.sh."""
    rig_env = {"DDILOCO_ENV": str(DEPLOY / "single-node" / "env.sh")}
    (learner,) = dry_run(rig, "learners.sbatch", SLURM_ARRAY_TASK_ID="0", **rig_env)
    a = parses(learner)
    assert (a.device, a.threads, a.config) == ("cpu", 1, str(DEPLOY / "single-node" / "tiny.toml"))
    torchrun_parses(learner)
    assert learner[learner.index("--nproc-per-node") + 1] == "2"


def test_submit_sizes_the_array_from_the_config_and_requeues_every_job(rig):
    config = DEPLOY / "single-node" / "tiny.toml"  # run.num_learners = 2
    sbatch = dry_run(rig, "submit.sh", CONFIG=str(config))
    assert [c[-1] for c in sbatch] == [str(DEPLOY / job) for job in JOBS]
    for c in sbatch:
        assert c[0] == "sbatch" and "--requeue" in c
    learners = sbatch[1]
    assert learners[learners.index("--array") + 1] == "0-1"
    assert learners[learners.index("--gpus-per-node") + 1] == "8"


# -- the restart logic, run for real with a stand-in learner ---------------------------------------

FAKE_PYTHON = """#!/usr/bin/env bash
# `python -m ddiloco ...` exits with the next code of FAKE_CODES (0 once they run out); the rest is python
if [ "$1" = "-m" ] && [ "$2" = "ddiloco" ]; then
    echo "$*" >> "$FAKE_DIR/runs"
    n=$(wc -l < "$FAKE_DIR/runs")
    code=$(echo "$FAKE_CODES" | cut -d' ' -f"$n")
    exit "${code:-0}"
fi
exec REAL "$@"
"""


def learner_job(tmp: Path, codes: str, **extra: str) -> subprocess.Popen:
    """learners.sbatch as element 1, its learner a stand-in exiting with ``codes`` in turn."""
    fake = tmp / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "python").write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    (fake / "python").chmod(0o755)
    env = clean_env(tmp, SLURM_ARRAY_TASK_ID="1", LEARNER_RANKS_PER_NODE="1", LEARNER_NODES="1",
                    FAKE_DIR=str(fake), FAKE_CODES=codes, **{"RESTART_BACKOFF_S": "0", **extra})  # fmt: skip
    env.pop("DDILOCO_DRY_RUN")
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    # (output to a file: a background `sleep` of the script's may hold a pipe open after it exits)
    with open(tmp / "job.log", "w") as log:
        return subprocess.Popen(
            ["bash", str(DEPLOY / "learners.sbatch")], env=env, stdout=log, stderr=subprocess.STDOUT
        )


def runs(tmp: Path) -> int:
    path = tmp / "fake" / "runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize(
    "codes,exit_code,started",
    [
        ("0", 0, 1),  # the run ended
        ("7 4 0", 0, 3),  # gave up, comm died: started again each time, until the end
        ("5 130 0", 0, 3),  # no syncer answered; stopped by a signal of its own (not the job's)
        ("7 2", 2, 2),  # a bad argument, config or key file: no restart fixes it
        ("3", 3, 1),  # refused by the syncer
        ("6", 6, 1),  # superseded
        ("7 7 7 7", 7, 3),  # MAX_RESTARTS=2: three starts, then the job gives up with the learner's code
    ],
)
def test_a_learner_process_is_started_again_only_for_what_a_restart_can_fix(rig, codes, exit_code, started):
    job = learner_job(rig, codes, MAX_RESTARTS="2")
    job.wait(timeout=120)
    assert (job.returncode, runs(rig)) == (exit_code, started), (rig / "job.log").read_text()


def test_a_signal_during_the_backoff_starts_nothing_new(rig):
    """SIGTERM (scancel, a requeue) while the job waits to restart its learner: it exits 130 and
    starts no process that Slurm would only SIGKILL."""
    import signal
    import time

    job = learner_job(rig, "7 0", RESTART_BACKOFF_S="60")
    deadline = time.monotonic() + 60
    while runs(rig) < 1 and time.monotonic() < deadline:  # the first learner has exited 7 ...
        time.sleep(0.05)
    time.sleep(0.5)  # ... and the job is in its 60 s backoff
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=60)
    out = (rig / "job.log").read_text()
    assert job.returncode == 130 and runs(rig) == 1, out
    assert "nothing started again" in out
