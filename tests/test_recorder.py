"""The syncer's flight recorder: a real syncer (a thread over the in-process network) records
what its session is handed while two learners train; the recording then replays through a
fresh session in virtual time and decides exactly what the live syncer decided. Progress is
waited for with bounds; nothing is asserted about durations."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import merges, wait_for
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.report.tape import read_tape
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.service.syncer.recorder import RecordingError, read_recording, replay

ADDRESS = "inproc://recorded-syncer"
SETTINGS = [
    "algo.sync_every=4",
    "algo.liveness_timeout_s=1.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=1.0",
    "runtime.snapshot_interval_s=1.0",
    "runtime.backoff_max_s=0.3",
    "runtime.join_timeout_s=10.0",
    "runtime.record_mb=64",
]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def rounds(records: list[dict]) -> list[dict]:
    """Round records as the tape holds them, without the file's wall-clock offset."""
    return [{k: v for k, v in r.items() if k != "wall_offset"} for r in records if r.get("event") == "round"]


@pytest.fixture
def recorded(tmp_path):
    """A run of a recorded syncer with two learners, stopped after some merges."""
    torch.set_num_threads(1)
    cfg = load_config(None, SETTINGS)
    net = InProcessNetwork()
    server = ddiloco.SyncerServer(model(), ADDRESS, tmp_path, config=cfg, transport=net.syncer(ADDRESS), fsync=False)
    server.start()
    stop = threading.Event()

    def learner(m: int) -> None:
        net_model = model()
        opt = torch.optim.SGD(net_model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(m)
        with ddiloco.Learner(net_model, ADDRESS, learner_id=m, config=cfg, optimizer=opt,
                             transport=net.learner) as ln:  # fmt: skip
            while not stop.is_set():
                x = torch.randn(16, 8, generator=g)
                loss = F.mse_loss(net_model(x), x.sum(1, keepdim=True))
                loss.backward()
                opt.step()
                opt.zero_grad()
                ln.step(tokens=16)
                stop.wait(0.005)

    threads = [threading.Thread(target=learner, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(merges(tmp_path)) >= 12, 120, "12 merges")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        server.stop()
    (path,) = (tmp_path / "recordings").glob("syncer-0-*.rec")
    return tmp_path, path


@pytest.mark.slow
def test_a_recorded_syncer_replays_in_virtual_time_to_the_same_decisions(recorded):
    run_dir, path = recorded
    live = rounds(read_tape(run_dir / "state" / "tape.jsonl"))
    again = replay(path)
    assert not again.cut
    replayed = rounds(again.tape)
    # The live syncer ran on past the recording's last input only to shut down (a flush, not recorded).
    assert len(live) >= 12 and replayed == [r for r in live if r["close_reason"] != "flush"]


@pytest.mark.slow
def test_a_damaged_recording_is_one_clear_error(recorded, tmp_path):
    _, path = recorded
    data = path.read_bytes()
    bad = tmp_path / "bad.rec"
    # Cut inside the last record (a cut at a record boundary is a readable, shorter recording).
    bad.write_bytes(data[:-1])
    with pytest.raises(RecordingError, match="truncated or damaged"):
        read_recording(bad)
    bad.write_bytes(data[:12] + b"{not json" + data[21:])  # the first record's header
    with pytest.raises(RecordingError, match="not JSON|truncated or damaged"):
        read_recording(bad)
    # A record that reads but does not replay: a tick without its time, a peer that is not hex.
    for old, new in ((b'{"kind": "tick", "t": ', b'{"kind": "tick", "u": '), (b'"peer": "', b'"peer": "z')):
        at = data.index(old)
        bad.write_bytes(data[:at] + new + data[at + len(old) + (len(new) - len(old)) :])
        with pytest.raises(RecordingError, match="header is damaged"):
            replay(bad)
    # The drift sketch's seed that is not a number (the header keeps its length: quoted letters).
    at = data.index(b'"sketch_seed": ') + len(b'"sketch_seed": ')
    end = at + len(data[at:].split(b",", 1)[0])
    bad.write_bytes(data[:at] + b'"' + b"z" * (end - at - 2) + b'"' + data[end:])
    with pytest.raises(RecordingError, match="start state is damaged"):
        replay(bad)
    bad.write_bytes(b"nope" + data[4:])
    with pytest.raises(RecordingError, match="not a ddiloco flight recording"):
        read_recording(bad)
