"""``SyncerServer(calibrate=)``: the final model's BatchNorm statistics re-estimated on its own
weights at the run's end (the merged ones were measured by the learners on theirs), in the final
model file, the final evaluation and the model given back; a calibration that fails leaves the
merged statistics with one line; a syncer started again on the ended folder keeps them."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_RUNTIME
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.errors import UsageError
from ddiloco.report.summary import summarise
from ddiloco.report.tape import read_jsonl
from ddiloco.service.base.transport import InProcessNetwork

ADDRESS = "inproc://calibrate-syncer"
STATS = ("bn.running_mean", "bn.running_var")


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def data(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = 2 + 3 * torch.randn(16, 6, generator=g)
        out.append((x, (x[:, 0] > x[:, 1]).long() + (x[:, 2] > 2).long()))
    return out


CALIBRATION = [x for x, _ in data(99, 8)]


def cfg():
    return load_config(
        None, ["algo.sync_every=6", "run.processed_tokens=3200", "runtime.end_linger_s=0", *FAST_RUNTIME]
    )


def run(tmp_path, calibrate, evaluate=None) -> ddiloco.SyncerServer:
    """A syncer and two learners (threads, SGD with momentum) to the run's end."""
    torch.set_num_threads(1)
    net = InProcessNetwork()
    torch.manual_seed(0)
    server = ddiloco.SyncerServer(
        BNNet(), ADDRESS, tmp_path, config=cfg(), transport=net.syncer(ADDRESS), fsync=False,
        calibrate=calibrate, evaluate=evaluate, eval_every_tokens=None if evaluate is None else 10**9,
    )  # fmt: skip
    server.start()
    errors: list[BaseException] = []

    def learn(m: int) -> None:
        try:
            model = BNNet()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            with ddiloco.Learner(
                model, ADDRESS, learner_id=m, config=cfg(), optimizer=opt, transport=net.learner
            ) as ln:
                for x, y in data(m, 400):
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                    ln.step(tokens=len(x))
                    if ln.run_ended:
                        break
                assert ln.finish(timeout_s=60)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=learn, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    server.stop(timeout_s=120)
    assert not errors, errors
    return server


def test_the_final_model_takes_statistics_measured_on_its_own_weights(tmp_path):
    evaluated: list[dict[str, torch.Tensor]] = []

    def evaluate(model: nn.Module) -> float:
        evaluated.append({k: v.clone() for k, v in model.state_dict().items()})
        return 1.0

    server = run(tmp_path, lambda m: ddiloco.recalibrate_batch_norm(m, CALIBRATION), evaluate)
    final = ddiloco.load_state_dict(tmp_path)
    expected = BNNet()
    expected.load_state_dict(final)
    ddiloco.recalibrate_batch_norm(expected, CALIBRATION)  # the final weights' own statistics
    for name in STATS:
        torch.testing.assert_close(final[name], expected.state_dict()[name])
        assert torch.equal(server.model.state_dict()[name], final[name])  # the model given back
        assert torch.equal(evaluated[-1][name], final[name])  # the final evaluation's copy
    # the merged count stays: what the run measured, not the calibration's 8 batches
    merged = merged_values(server)
    assert torch.equal(final["bn.num_batches_tracked"].float(), merged["bn.num_batches_tracked"])
    assert not torch.equal(final["bn.running_var"], merged["bn.running_var"])
    assert any(e.get("final") for e in read_jsonl(tmp_path / "metrics" / "eval.jsonl"))
    # one number for the tokens processed: the end's count, in its record, its reason and the summary
    end = [r for r in read_jsonl(tmp_path / "metrics" / "run.jsonl") if r.get("what") == "end"][-1]
    assert end["processed_tokens"] >= 3200 and f"{end['processed_tokens']:,.0f} tokens processed" in end["reason"]
    assert summarise(tmp_path)["tokens_processed"] == end["processed_tokens"]
    assert server.service.status()["processed_tokens"] == end["processed_tokens"]
    final_eval = [e for e in read_jsonl(tmp_path / "metrics" / "eval.jsonl") if e.get("final")][-1]
    assert final_eval["tokens"] == end["processed_tokens"]  # (every record said 0 before)
    # A syncer started again on the ended folder (no calibrate=) leaves the final model as it is.
    again = ddiloco.SyncerServer(BNNet(), ADDRESS, tmp_path, config=cfg(), transport=InProcessNetwork().syncer(ADDRESS),
                                 fsync=False)  # fmt: skip
    again.start()
    again.stop(timeout_s=60)
    after = ddiloco.load_state_dict(tmp_path)
    for name in STATS:
        assert torch.equal(after[name], final[name])


def test_a_calibration_that_fails_leaves_the_merged_statistics_with_one_line(tmp_path, caplog):
    def broken(model: nn.Module) -> None:
        model.bn.running_var.fill_(-1.0)

    with caplog.at_level(logging.WARNING, logger="ddiloco"):
        server = run(tmp_path, broken)
    said = [r.getMessage() for r in caplog.records if "calibrate= failed" in r.getMessage()]
    assert said == [
        "calibrate= failed (ValueError: bn.running_var has a negative variance); the final model keeps the merged "
        "statistics: check the function on a copy of the model (ddiloco.recalibrate_batch_norm(model, batches))"
    ]
    final = ddiloco.load_state_dict(tmp_path)
    merged = merged_values(server)
    for name in STATS:
        assert torch.equal(final[name], merged[name])
    assert bool((final["bn.running_var"] >= 0).all())


def merged_values(server: ddiloco.SyncerServer) -> dict[str, torch.Tensor]:
    """The syncer core's values by tensor name (the merged ones: calibrate= never changes them)."""
    core = server.service.core
    return {pc.name: v for p in core.owned for pc, v in zip(core.layout.fragments[p], core.values(p))}


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"calibrate": CALIBRATION}, "calibrate must be a function of the model, not a list: calibrate=lambda model"),
        ({"calibrate": print, "num_shards": 2}, "calibrate= needs the whole model, which a sharded syncer does not"),
    ],
)
def test_a_wrong_calibrate_is_one_line(tmp_path, kwargs, says):
    with pytest.raises(UsageError) as err:
        ddiloco.SyncerServer(BNNet(), "tcp://127.0.0.1:*", tmp_path, config=cfg(), insecure=True, **kwargs)
    assert str(err.value).startswith(says)
