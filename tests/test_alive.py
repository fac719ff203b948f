"""``ddiloco alive RUN_DIR --within SECONDS``: exit 0 when the learner's status file was written
within SECONDS, else 1 with one line; bad arguments exit 2 with one line. File ages are set with
os.utime, so nothing here waits or depends on timing."""

from __future__ import annotations

import json
import os
import time

import pytest

from ddiloco.cli import main


def _status(run_dir, learner: int, age_s: float = 0.0, name: str | None = None):
    path = run_dir / "status" / (name or f"learner-{learner}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"learner": learner}))
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_a_fresh_status_file_is_alive(tmp_path, capsys):
    _status(tmp_path, 3, age_s=1.0)
    assert main(["alive", str(tmp_path), "--learner", "3", "--within", "60"]) == 0
    assert "learner-3.json written" in _one_line(capsys.readouterr().out)


def test_a_stale_status_file_is_not(tmp_path, capsys):
    _status(tmp_path, 0, age_s=600.0)
    assert main(["alive", str(tmp_path), "--learner", "0", "--within", "60"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "learner-0.json is 6" in line and "older than 60 s" in line


def test_a_missing_status_file_is_not(tmp_path, capsys):
    _status(tmp_path, 1)  # another learner's file does not count
    assert main(["alive", str(tmp_path), "--learner", "0", "--within", "60"]) == 1
    assert "learner-0.json is missing" in _one_line(capsys.readouterr().err)
    assert main(["alive", str(tmp_path / "nothing-here"), "--within", "60"]) == 1
    assert "is missing" in _one_line(capsys.readouterr().err)


def test_without_an_id_the_one_learner_in_the_folder_counts(tmp_path, capsys):
    _status(tmp_path, 2, age_s=1.0)
    _status(tmp_path, 2, age_s=900.0, name="learner-2.rank1.json")  # another rank's file is not rank 0's
    assert main(["alive", str(tmp_path), "--within", "60"]) == 0
    assert "learner-2.json" in capsys.readouterr().out
    _status(tmp_path, 5, age_s=1.0)
    assert main(["alive", str(tmp_path), "--within", "60"]) == 2
    assert "learners 2, 5: say which with --learner M" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--within", "60"], "RUN_DIR"),  # no run folder
        (["RUN"], "--within"),  # no bound
        (["RUN", "--within", "soon"], "'soon' is not a number of seconds"),
        (["RUN", "--within", "0"], "out of range"),
        (["RUN", "--within", "inf"], "out of range"),
        (["RUN", "--within", "60", "--learner", "-1"], "out of range"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["alive", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err.strip().splitlines()[-1]
