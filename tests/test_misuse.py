"""Misuse, from the user's side: each test is a tutorial snippet gone wrong, and asserts the one
line the user is told (issue 19). Syncers and learners are threads of this process on the
in-process network, or on loopback ZeroMQ with CURVE keys for the key cases; every wait is
bounded, and nothing asserts a duration."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_RUNTIME, wait_for
from torch import nn

import ddiloco
from ddiloco.config import load_config
from ddiloco.protocol.settings import UNSAID_AT  # a dense run leaves the densities unsaid
from ddiloco.service.base.keys import forget_local_keys, make_keys
from ddiloco.service.base.transport import InProcessNetwork
from ddiloco.settings import SETTINGS as RUN_SETTINGS

torch.set_num_threads(1)
ADDRESS = "inproc://misuse-syncer"
SETTINGS = [
    "run.num_learners=2",
    "run.processed_tokens=123456",
    "algo.sync_every=8",
    *FAST_RUNTIME,
    "runtime.join_timeout_s=5.0",
]
ADVICE = "make every model change (dtype, device, shapes, modules) before creating the Learner"


class Net(nn.Module):
    """A user's model with a BatchNorm: its running statistics are synced tensors too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.body(x))))


def cfg(*extra: str):
    return load_config(None, [*SETTINGS, *extra])


def train_step(learner: ddiloco.Learner, model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    """One step of the user's loop (its batch counts as 100 tokens: budgets of a few thousand end soon)."""
    x = torch.randn(16, 8, generator=g)
    loss = F.cross_entropy(model(x), (x.sum(1) > 0).long())
    loss.backward()
    opt.step()
    opt.zero_grad()
    learner.step(tokens=100, loss=loss)


class Cuttable:
    """A learner's transport a test can cut off and heal (a partition, both ways)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.cut = inner, False

    def send(self, link: int, frames: Any) -> bool:
        return True if self.cut else self.inner.send(link, frames)

    def recv(self, timeout_s: float) -> list[Any]:
        got = self.inner.recv(timeout_s)
        return [] if self.cut else got

    def reconnect(self, link: int) -> None:
        self.inner.reconnect(link)

    def wake(self) -> None:
        self.inner.wake()

    def handshake_failure(self) -> None:
        return None

    def close(self, linger_s: float = 0.0) -> None:
        self.inner.close(linger_s)


def serve(net: InProcessNetwork, run_dir: Path, *extra: str) -> ddiloco.SyncerServer:
    torch.manual_seed(0)
    return ddiloco.SyncerServer(
        Net(), ADDRESS, run_dir, config=cfg(*extra), transport=net.syncer(ADDRESS), fsync=False
    ).start()


@pytest.fixture
def fleet(tmp_path):
    net = InProcessNetwork()
    server = serve(net, tmp_path)
    yield net, server, tmp_path
    server.stop()


def raised(fn: Any, error: type[BaseException], timeout: float = 15.0) -> BaseException:
    """Call ``fn`` until it raises ``error`` (bounded); the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fn()
        except error as e:
            return e
        time.sleep(0.02)
    raise AssertionError(f"no {error.__name__} within {timeout} s")


# -- 3: the run's settings come from the syncer ------------------------------------------------


def test_a_learner_without_config_adopts_the_runs_settings(fleet):
    net, server, _ = fleet
    learner = ddiloco.Learner(Net(), ADDRESS, learner_id=0, transport=net.learner)  # no config=
    assert learner.cfg.run.processed_tokens == 123456  # the LR recipe's horizon is the run's
    assert (learner.cfg.run.num_learners, learner.cfg.algo.sync_every) == (2, 8)
    assert learner.layout.digest == server.service.layout.digest
    # given only the algorithm's settings, it adopts the rest
    algo = cfg().algo
    with ddiloco.Learner(Net(), ADDRESS, learner_id=1, config=algo, transport=net.learner) as other:
        assert other.cfg.run.processed_tokens == 123456
    learner.close()


def test_a_conflicting_explicit_config_is_refused_naming_the_first_key(fleet):
    net, _, _ = fleet
    with pytest.raises(ddiloco.RefusedError) as e:
        ddiloco.Learner(Net(), ADDRESS, learner_id=0, config=cfg("run.processed_tokens=600000"), transport=net.learner)
    assert str(e.value) == (
        "learner 0 was refused by the syncer: its settings differ from the run's: run.processed_tokens is 600000 on "
        "this learner and 123456 on the syncer: give it the run's config (the syncer's config.toml), or none, to "
        "adopt the run's settings"
    )
    algo = cfg("algo.sync_every=16").algo  # only the algorithm's settings: those must agree
    with pytest.raises(ddiloco.RefusedError, match="algo.sync_every is 16 on this learner and 8 on the syncer: give"):
        ddiloco.Learner(Net(), ADDRESS, learner_id=0, config=algo, transport=net.learner)


def test_an_id_outside_the_cap_is_refused_and_not_listed(fleet):
    net, server, _ = fleet
    line = (
        "learner 5 was refused by the syncer: learner id 5 is outside this run's ids 0..1 (run.num_learners = 2): use "
        "one of them, or grow the fleet: restart the syncer with a larger run.num_learners (and keys for the new "
        "ids: ddiloco keys DIR --learners M)"
    )
    for config in (cfg(), None):  # with a config (registration) and without (the settings question)
        with pytest.raises(ddiloco.RefusedError) as e:
            ddiloco.Learner(Net(), ADDRESS, learner_id=5, config=config, transport=net.learner)
        assert str(e.value) == line
    assert [entry["learner"] for entry in server.service.status()["learners"]] == []


def test_the_fleet_grows_by_restarting_the_syncer_with_a_larger_cap(tmp_path):
    net = InProcessNetwork()
    server = serve(net, tmp_path)
    with pytest.raises(ddiloco.RefusedError, match="learner id 3 is outside this run's ids 0..1"):
        ddiloco.Learner(Net(), ADDRESS, learner_id=3, transport=net.learner)
    server.stop()
    server = serve(net, tmp_path, "run.num_learners=4")  # the same run folder: it resumes, with room for 4
    try:
        with ddiloco.Learner(Net(), ADDRESS, learner_id=3, transport=net.learner) as learner:
            assert learner.cfg.run.num_learners == 4
    finally:
        server.stop()


# -- 4: misuse gets one true line ----------------------------------------------------------------


def test_a_superseded_learner_is_told_at_its_next_step(fleet):
    net, _, _ = fleet
    ends: list[Cuttable] = []

    def transport(addrs: list[str], ident: bytes) -> Cuttable:
        ends.append(Cuttable(net.learner(addrs, ident)))
        return ends[-1]

    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    g = torch.Generator().manual_seed(1)
    old = ddiloco.Learner(model, ADDRESS, learner_id=1, config=cfg(), optimizer=opt, transport=transport)
    train_step(old, model, opt, g)
    ends[0].cut = True  # a partition: the syncer hears nothing from it, and a new process takes id 1
    new = ddiloco.Learner(Net(), ADDRESS, learner_id=1, config=cfg(), transport=net.learner)
    ends[0].cut = False  # healed: the old process registers again, and is told
    e = raised(lambda: train_step(old, model, opt, g), ddiloco.RefusedError)
    assert str(e) == (
        f"learner 1 was superseded by a newer process with the same id (pid {os.getpid()}): this process must stop"
    )
    new.close()
    old.close()


def test_a_second_live_process_with_the_same_id_is_told_the_id_is_held(fleet):
    net, _, _ = fleet
    holder = ddiloco.Learner(Net(), ADDRESS, learner_id=1, config=cfg(), transport=net.learner)
    with pytest.raises(ddiloco.RefusedError) as e:  # the holder's comm thread keeps it heard
        ddiloco.Learner(Net(), ADDRESS, learner_id=1, config=cfg("runtime.join_timeout_s=1.5"), transport=net.learner)
    holder.close()
    assert re.fullmatch(
        r"learner 1 was refused by the syncer: learner id 1 is held by a live process \(heard \d+\.\d s ago\); use "
        r"another id, or stop that process",
        str(e.value),
    ), str(e.value)


def test_no_learner_trains_after_the_run_has_ended_also_one_that_joins_later(tmp_path):
    """The run's end is persisted in its folder: a syncer started again on it tells whoever asks."""
    net = InProcessNetwork()
    server = serve(net, tmp_path, "run.processed_tokens=2000", "runtime.end_linger_s=0.2")
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    g = torch.Generator().manual_seed(0)
    learner = ddiloco.Learner(model, ADDRESS, learner_id=0, transport=net.learner)
    wait_for(lambda: train_step(learner, model, opt, g) or learner.run_ended, 30, "the run's end")
    with pytest.raises(ddiloco.UsageError) as e:  # a loop that does not check run_ended is stopped
        train_step(learner, model, opt, g)
    assert str(e.value) == (
        f"learner 0: the run has ended ({learner.end_reason}); step() trains no more: leave the loop when "
        "learner.run_ended is true and call learner.finish()"
    )
    assert learner.finish()
    server.stop()
    server = serve(net, tmp_path, "run.processed_tokens=2000", "runtime.end_linger_s=30")  # the folder says: over
    try:
        for config in (None, cfg("run.processed_tokens=2000")):
            with ddiloco.Learner(Net(), ADDRESS, learner_id=1, config=config, transport=net.learner) as late:
                assert late.run_ended and "2,000 (run.processed_tokens)" in late.end_reason
                with pytest.raises(ddiloco.UsageError, match="the run has ended"):
                    late.step(tokens=16)
    finally:
        server.stop()


def test_a_learner_cut_off_while_the_run_ends_is_told_when_it_is_back(tmp_path):
    net = InProcessNetwork()
    run = ("run.processed_tokens=3000", "runtime.end_linger_s=30")
    server = serve(net, tmp_path, *run)
    ends: list[Cuttable] = []

    def transport(addrs: list[str], ident: bytes) -> Cuttable:
        ends.append(Cuttable(net.learner(addrs, ident)))
        return ends[-1]

    try:
        models = [Net(), Net()]
        opts = [torch.optim.AdamW(m.parameters()) for m in models]
        g = torch.Generator().manual_seed(0)
        cut_off = ddiloco.Learner(models[0], ADDRESS, learner_id=0, config=cfg(*run), transport=transport)
        other = ddiloco.Learner(models[1], ADDRESS, learner_id=1, config=cfg(*run), transport=net.learner)
        ends[0].cut = True
        wait_for(lambda: train_step(other, models[1], opts[1], g) or other.run_ended, 30, "the run's end")
        assert other.finish()
        assert not cut_off.run_ended  # it trained on, cut off, and heard nothing
        train_step(cut_off, models[0], opts[0], g)
        ends[0].cut = False
        wait_for(lambda: train_step(cut_off, models[0], opts[0], g) or cut_off.run_ended, 15, "the end, heard late")
        with pytest.raises(ddiloco.UsageError, match="the run has ended"):
            train_step(cut_off, models[0], opts[0], g)
        cut_off.close()
    finally:
        server.stop()


def test_a_learner_that_cannot_reach_its_syncer_gives_up(fleet):
    net, server, _ = fleet
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    g = torch.Generator().manual_seed(0)
    learner = ddiloco.Learner(
        model, ADDRESS, learner_id=0, config=cfg("runtime.give_up_after_s=1.5"), optimizer=opt, transport=net.learner
    )
    train_step(learner, model, opt, g)
    server.stop()  # gone for good
    e = raised(lambda: train_step(learner, model, opt, g), ddiloco.CommError)
    assert str(e) == (
        "learner 0: no word from syncer shard 0 for 1.5 s (runtime.give_up_after_s): it is gone, or the run ended "
        "while this learner was cut off (ddiloco status RUN_DIR says which); this learner stops"
    )
    learner.close()


@pytest.mark.parametrize(
    "change, line",
    [
        (lambda m: m.to(torch.bfloat16), "parameter body.weight is torch.bfloat16, was torch.float32"),
        (lambda m: m.double(), "parameter body.weight is torch.float64, was torch.float32"),
        (
            lambda m: setattr(m.head, "weight", nn.Parameter(torch.zeros(4, 16))),
            "parameter head.weight is a new tensor (the same shape (4, 16) and dtype torch.float32: the Learner "
            "would sync the old one)",
        ),
        (
            lambda m: setattr(m.bn, "running_var", torch.ones(16)),
            "buffer bn.running_var is a new tensor (the same shape (16,) and dtype torch.float32: the Learner would "
            "sync the old one)",
        ),
        (lambda m: setattr(m.head.bias, "data", torch.zeros(5)), "parameter head.bias has shape (5,), was (4,)"),
        (
            lambda m: setattr(m, "body", nn.Linear(8, 16)),
            "module body is a new module (parameter body.weight and the rest of it are no longer the model's)",
        ),
        (lambda m: delattr(m.head, "bias"), "parameter head.bias is gone"),
        (
            lambda m: m.bn.num_batches_tracked.data.__setattr__("x", 1)
            or setattr(m.bn.num_batches_tracked, "data", torch.tensor(0, dtype=torch.int32)),
            "buffer bn.num_batches_tracked is torch.int32, was torch.int64",
        ),
    ],
    ids=["bf16", "double", "new-parameter", "new-buffer", "reshaped", "new-module", "removed", "buffer-dtype"],
)
def test_a_model_change_after_the_learner_is_caught_at_the_next_step(change, line):
    model = Net()
    learner = ddiloco.Learner(model)  # standalone: the same checks, no network
    for _ in range(3):  # past the first step: the checks that run every step, whatever fragment is due
        learner.step(tokens=16)
    change(model)
    with pytest.raises(ddiloco.UsageError) as e:
        learner.step(tokens=16)
    assert str(e.value) == f"the model changed after the Learner was made: {line}; {ADVICE}"


def test_a_module_added_after_the_learner_is_caught_within_16_steps():
    model = Net()
    learner = ddiloco.Learner(model)
    learner.step(tokens=16)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ddiloco.UsageError) as e:
        for _ in range(16):
            learner.step(tokens=16)
    assert str(e.value) == f"the model changed after the Learner was made: parameter extra.weight is new; {ADVICE}"


def test_key_misuse_against_a_keyed_syncer_on_loopback_says_what_is_wrong(tmp_path):
    """CURVE on loopback (ZeroMQ): a missing key, another run's keys, a key the syncer does not
    admit, and an id outside the cap with a key of its own, each in one line, at once."""
    run = tmp_path / "run"
    make_keys(run / "keys", learners=6)  # keys for 6 ids; the run takes 2
    server = ddiloco.SyncerServer(Net(), "tcp://127.0.0.1:*", run, config=cfg(), fsync=False).start()
    addr = server.address
    forget_local_keys(addr)  # as in another process: the in-process registry would find the keys
    other = tmp_path / "other-run-keys"
    make_keys(other, learners=2)
    stranger = tmp_path / "stranger"  # the right syncer.key, a learner key the syncer never heard of
    make_keys(stranger, learners=2)
    (stranger / "syncer.key").write_bytes((run / "keys" / "syncer.key").read_bytes())
    fix = "pass the run's keys folder: key=RUN_DIR/keys (--keys RUN_DIR/keys)"
    try:
        cases = [
            (None, ddiloco.CommError,
             f"learner 0: the syncer at {addr} requires CURVE keys and this learner has none: pass key=RUN_DIR/keys "
             "(--keys RUN_DIR/keys)"),
            (other, ddiloco.CommError,
             f"learner 0: the CURVE handshake with the syncer at {addr} failed: the syncer.key this learner was given "
             f"is not that syncer's public key: {fix}"),
            (stranger, ddiloco.CommError,
             f"learner 0: the syncer at {addr} does not admit this learner's key (learner-0.key is not one of the "
             f"run's keys): {fix}"),
        ]  # fmt: skip
        for key, error, line in cases:
            with pytest.raises(error) as e:
                ddiloco.Learner(Net(), addr, learner_id=0, key=key, config=cfg())
            assert str(e.value) == line
        with pytest.raises(ddiloco.RefusedError) as e:
            ddiloco.Learner(Net(), addr, learner_id=5, key=run / "keys", config=cfg())
        assert str(e.value).startswith("learner 5 was refused by the syncer: learner id 5 is outside this run's ids")
        with ddiloco.Learner(Net(), addr, learner_id=1, key=run / "keys") as ok:  # and with the run's keys: joins
            assert ok.cfg.run.processed_tokens == 123456
    finally:
        server.stop()
    plain = ddiloco.SyncerServer(Net(), "tcp://127.0.0.1:*", tmp_path / "plain", config=cfg(), insecure=True).start()
    try:  # keys for a syncer that has none
        with pytest.raises(ddiloco.CommError) as e:
            ddiloco.Learner(Net(), plain.address, learner_id=0, key=run / "keys", config=cfg())
        assert str(e.value) == (
            f"learner 0: the syncer at {plain.address} runs without keys (insecure) and this learner has keys: pass "
            "insecure=True and no key (--insecure, no --keys), or start the syncer with its keys"
        )
    finally:
        plain.stop()


def test_the_cli_learner_exits_with_its_own_codes_when_superseded_or_given_up(tmp_path):
    from ddiloco.service.learner.process import EXIT_GAVE_UP, EXIT_SUPERSEDED, LearnerProcess
    from ddiloco.service.syncer.service import SyncerService

    synthetic = ["workload.factory=ddiloco.workloads.synthetic:make_workload", "workload.options={hidden = 8}"]
    config = cfg(*synthetic, "runtime.give_up_after_s=1.5", "runtime.step_sleep_s=0.01")
    net = InProcessNetwork()
    service = SyncerService(config, net.syncer(ADDRESS), tmp_path, fsync=False)
    syncer = threading.Thread(target=service.serve, daemon=True)
    syncer.start()
    ends: list[Cuttable] = []

    def transport(addrs: list[str], ident: bytes) -> Cuttable:
        ends.append(Cuttable(net.learner(addrs, ident)))
        return ends[-1]

    codes: dict[str, int] = {}
    old = LearnerProcess(config, [ADDRESS], 1, tmp_path, connect=transport)
    gone = LearnerProcess(config, [ADDRESS], 0, tmp_path, connect=net.learner)
    procs = {"old": old, "gone": gone}
    runs = [threading.Thread(target=lambda n=n, p=p: codes.__setitem__(n, p.run())) for n, p in procs.items()]
    try:
        for t in runs:
            t.start()
        wait_for(lambda: old.learner is not None and old.stats["steps"] > 0, 30, "learner 1 trains")
        ends[0].cut = True
        new = LearnerProcess(config, [ADDRESS], 1, tmp_path, connect=net.learner)
        new_learner = new._join()  # takes id 1 over once the old one has been silent for takeover_after_s
        ends[0].cut = False
        runs[0].join(timeout=20)
        assert codes.get("old") == EXIT_SUPERSEDED
        new_learner.close()
    finally:
        service.stop()
        syncer.join(timeout=30)
    runs[1].join(timeout=20)  # learner 0 lost its syncer for good
    assert codes.get("gone") == EXIT_GAVE_UP


# -- 6: say what happened ------------------------------------------------------------------------


def test_a_library_learner_says_join_hand_off_rejoin_and_run_end_at_info(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ddiloco")
    net = InProcessNetwork()
    run = cfg("run.processed_tokens=10000", "runtime.end_linger_s=5")
    server = serve(net, tmp_path, "run.processed_tokens=10000", "runtime.end_linger_s=5")
    ends: list[Cuttable] = []

    def transport(addrs: list[str], ident: bytes) -> Cuttable:
        ends.append(Cuttable(net.learner(addrs, ident)))
        return ends[-1]

    models = [Net(), Net()]
    opts = [torch.optim.AdamW(m.parameters()) for m in models]
    g = torch.Generator().manual_seed(0)
    try:
        first = ddiloco.Learner(models[0], ADDRESS, learner_id=0, config=run, optimizer=opts[0], transport=transport)
        wait_for(lambda: train_step(first, models[0], opts[0], g) or max(first.versions) > 0, 30, "a merge")
        ends[0].cut = True  # lost for longer than runtime.syncer_liveness_s: it registers again once back
        wait_for(lambda: train_step(first, models[0], opts[0], g) or not first.session.joined, 10, "the loss noticed")
        ends[0].cut = False
        wait_for(lambda: train_step(first, models[0], opts[0], g) or first.session.joined, 10, "the rejoin")
        # without a config: it asks for the run's settings
        second = ddiloco.Learner(models[1], ADDRESS, learner_id=1, optimizer=opts[1], transport=net.learner)

        def both() -> bool:
            for m, ln in enumerate((first, second)):
                if not ln.run_ended:
                    train_step(ln, models[m], opts[m], g)
            return first.run_ended and second.run_ended

        wait_for(both, 60, "the run's end")
        first.finish()
        second.finish()
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name.startswith("ddiloco")]
    patterns = {
        "join": r"learner 0 joined the run at inproc://misuse-syncer: global version 0 of its \d+ fragments "
        r"\(\d+/\d+ received\), data position 0, the fleet at 0 tokens",
        "late join": r"learner 1 joined the run at inproc://misuse-syncer: global version \d+(\.\.\d+)? of its "
        r"\d+ fragments \(\d+/\d+ received\), data position 0, the fleet at [\d,]+ tokens",
        "hand-off": r"learner 1: took learner 0's optimizer state \(its optimizer at step \d+\) at its own step \d+",
        "rejoin": r"learner 0: rejoined syncer shard 0 after \d+\.\d s \(its link was lost\); training went on "
        r"meanwhile",
        "end": r"learner 0: the syncer ended the run: [\d,]+ tokens processed by the fleet, the budget is 10,000 "
        r"\(run.processed_tokens\)",
        "adopted": rf"learner 1: adopted the run's {len(RUN_SETTINGS) - len(UNSAID_AT)} settings from the syncer",
    }
    for what, pattern in patterns.items():
        found = [line for line in lines if re.fullmatch(pattern, line)]
        assert len(found) == 1, (what, [line for line in lines if line.startswith(pattern[:12])])


def test_a_learner_given_a_model_that_holds_no_values_is_told_so() -> None:
    """A model on the meta device (the one a SyncerServer in this process serves holds its
    structure alone): one line, not a meta-device error at the first forward pass."""
    from ddiloco.errors import UsageError

    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(UsageError, match="holds no values"):
        ddiloco.Learner(model)


def test_an_id_without_a_key_in_a_keys_folder_is_told_the_folders_ids_not_to_make_keys(tmp_path):
    keys = tmp_path / "keys"
    make_keys(keys, learners=2)
    with pytest.raises(ddiloco.DDiLoCoError) as e:
        ddiloco.Learner(Net(), "tcp://127.0.0.1:9", learner_id=5, key=keys, config=cfg())
    assert str(e.value) == (
        f"learner-5 has no key in {keys}, which holds the keys of learners 0..1: give one of those ids "
        f"(run.num_learners), or make keys for more learners with `ddiloco keys {keys} --learners N`"
    )


def test_names_of_earlier_versions_say_what_they_became(fleet, caplog):
    with pytest.warns(DeprecationWarning, match=r"run\.tokens is now run\.processed_tokens \(.*\): read run\.proc"):
        assert cfg().run.tokens == cfg().run.processed_tokens
    with caplog.at_level("WARNING", logger="ddiloco.config"):  # a config key: read as its new name, one line
        assert load_config(None, ["run.tokens=1234"]).run.processed_tokens == 1234
    assert [r.getMessage() for r in caplog.records if "run.tokens" in r.getMessage()] == [
        "run.tokens is now run.processed_tokens (tokens the whole fleet processes: the budget every method is "
        "compared at and the LR schedule's horizon; a budget of tokens merged into the global model is "
        "run.merged_tokens); it is read as run.processed_tokens for this release: rename the key"
    ]
    with pytest.raises(ddiloco.DDiLoCoError, match="run.tokens and run.processed_tokens are both set: run.tokens "
                       "is run.processed_tokens's earlier name; keep run.processed_tokens only"):  # fmt: skip
        load_config(None, ["run.tokens=1234", "run.processed_tokens=99"])
    with pytest.raises(AttributeError, match="'RunSection' object has no attribute 'nope'"):
        cfg().run.nope  # noqa: B018
    net, _, _ = fleet
    with (
        ddiloco.Learner(Net(), ADDRESS, learner_id=0, transport=net.learner) as learner,
        pytest.warns(DeprecationWarning, match="fleet_tokens"),
    ):
        assert learner.global_tokens == learner.fleet_tokens
