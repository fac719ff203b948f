"""What one valid key can do, tried from the attacker's side (issue 18, items 2, 3 and 5).

- A key routes as itself: a connection with another key (an observer's, another learner's) that
  claims learner m's name neither registers as m nor takes m's route; an older process cannot
  take its id's route back; a learner the syncer does not know on its connection is told so and
  reconnects on a fresh connection.
- The optimizer hand-off only as asked: requests deduplicated and paced per requester, served
  one at a time, only the chosen peer's answer relayed; a learner loads only validated state
  tensors and keeps its own hyper-parameters.
- Limits per key, charged on receipt before decoding.

Pure session tests and virtual-time runs (``sim.faults.Inject``, ``HostilePeerState``) are
deterministic; the transport tests use real ZeroMQ sockets on loopback with bounded waits and
no timing assertions.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from helpers import (
    SESSION_CFG,
    SESSION_LAYOUT,
    SESSION_PARAMS,
    SESSION_REGISTRATION,
    SESSION_RT,
    SESSION_SPECS,
    wait_for,
)
from test_faults import SMALL  # the fault harness's small synthetic run

from ddiloco.core.messages import Contribution, FragmentUpdate, Heartbeat
from ddiloco.core.syncer import Syncer
from ddiloco.protocol.fleet import FleetBook
from ddiloco.protocol.learner_session import LearnerSession
from ddiloco.protocol.messages import (
    FetchGlobal,
    GlobalState,
    JoinReply,
    PeerState,
    PeerStateRequest,
    Register,
    SyncerHeartbeat,
)
from ddiloco.protocol.syncer_session import Budget, Principal, SyncerSession
from ddiloco.training.peer_state import load_state, state_message

SPECS, LAYOUT, PARAMS = SESSION_SPECS, SESSION_LAYOUT, SESSION_PARAMS
REGISTRATION, CFG, RT = SESSION_REGISTRATION, SESSION_CFG, SESSION_RT


def syncer(keyed: bool = False, budget: Budget | None = None, ended: str | None = None) -> SyncerSession:
    core = Syncer(
        CFG, LAYOUT, {"w": torch.zeros(3, 2), "b": torch.zeros(2)}, [False] * sum(len(f) for f in LAYOUT.fragments)
    )
    return SyncerSession(core, RT, budget or Budget(), REGISTRATION, 0.0, keyed=keyed, ended=ended)


def register(s: SyncerSession, m: int, peer: object, now: float = 0.0, incarnation: int = 1, key: bool = False):
    principal = Principal("learner", m) if key else None
    return s.receive(peer, Register(m, incarnation, PARAMS, REGISTRATION.layout), now, principal)


def replies(out, peer) -> list:
    return [msg for p, msg in out.send if p == peer]


# -- (2) a key routes as itself -------------------------------------------------------------


def test_a_registration_retried_on_the_same_connection_is_answered_without_the_join_again():
    """A learner retries its Register after 0.1 s; a loaded syncer answers later. The retry on
    the same connection gets its acceptance again, not the join's fragments a second time
    (they are on their way); a new connection (the learner reconnected) gets them again."""
    s = syncer()
    first = register(s, 0, "conn-a")
    joined = [m for m in replies(first, "conn-a") if isinstance(m, FragmentUpdate)]
    assert len(joined) == LAYOUT.num_fragments
    again = replies(register(s, 0, "conn-a", now=0.2), "conn-a")
    assert [type(m) for m in again] == [JoinReply] and again[0].accepted
    anew = replies(register(s, 0, "conn-b", now=0.4), "conn-b")
    assert sum(isinstance(m, FragmentUpdate) for m in anew) == LAYOUT.num_fragments


def test_another_key_claiming_a_learner_neither_registers_nor_takes_its_route():
    s = syncer(keyed=True)
    register(s, 0, "conn-a", key=True)
    assert s.identities[0] == "conn-a"
    for principal in (Principal("observer"), Principal("learner", 1)):
        out = s.receive("conn-x", Register(0, 2, PARAMS, REGISTRATION.layout), 5.0, principal)
        assert [n.kind for n in out.notes] == ["impostor"]
        reply = replies(out, "conn-x")[0]
        assert isinstance(reply, JoinReply) and not reply.accepted
        out = s.receive("conn-x", Heartbeat(0, 1, 1, 0.1, 8, 0.1), 5.0, principal)
        assert [n.kind for n in out.notes] == ["impostor"] and not out.send
    assert s.identities[0] == "conn-a"  # the route is untouched
    assert all(p == "conn-a" for p, _ in s.tick(10.0).send)  # heartbeats still go to learner 0's connection


def test_a_peer_not_bound_to_the_learner_it_claims_is_told_and_nothing_it_sends_is_taken():
    s = syncer()
    register(s, 0, "conn-a")
    out = s.receive("conn-b", Heartbeat(0, 1, 1, 0.1, 8, 0.1), 1.0)
    assert [n.kind for n in out.notes] == ["unknown_sender"]
    assert replies(out, "conn-b") == [SyncerHeartbeat(s.epoch, 0, bound=False)]
    assert s.identities[0] == "conn-a"


def test_an_older_process_cannot_take_its_ids_route_back_and_is_told_it_is_superseded():
    s = syncer()
    register(s, 0, "old", incarnation=1)
    out = register(s, 0, "new", now=5.0, incarnation=2)  # the holder was silent past takeover_after_s
    assert s.identities[0] == "new"
    told = replies(out, "old")
    assert len(told) == 1 and not told[0].accepted and "newer process" in told[0].reason
    out = register(s, 0, "old", now=6.0, incarnation=1)  # the old process resumes and registers again
    reply = replies(out, "old")[0]
    assert not reply.accepted and reply.retry_after_s == 0 and "superseded" in reply.reason
    assert [n.kind for n in out.notes] == ["superseded"] and s.identities[0] == "new"


def joined_learner(m: int = 0) -> tuple[LearnerSession, float]:
    ln = LearnerSession(CFG, RT, m, 1, LAYOUT, REGISTRATION, 0.0, wants_peer_state=True)
    ln.tick(0.0)
    ln.receive(0, JoinReply(True, "", 7, 0, [0, 1]), 0.1)
    assert ln.joined
    return ln, 0.1


def test_a_learner_told_its_connection_is_not_bound_reconnects_and_registers_again():
    ln, now = joined_learner()
    out = ln.receive(0, SyncerHeartbeat(7, 0, bound=False), now + 0.1)
    assert out.reconnect == [0] and not ln.joined
    sent = ln.tick(now + 0.1).send
    assert any(isinstance(s.msg, Register) for s in sent)


def test_a_learner_that_hears_nothing_reconnects_on_a_fresh_connection():
    ln, now = joined_learner()
    out = ln.tick(now + RT.syncer_liveness_s + 0.5)
    assert out.reconnect == [0] and any(isinstance(s.msg, Register) for s in out.send)
    assert any("reconnecting" in n for n in out.notes)


# -- (3) the optimizer hand-off only as asked -------------------------------------------------


def two_live_learners(s: SyncerSession) -> None:
    for m, peer in ((0, "a"), (1, "b"), (2, "c")):
        register(s, m, peer)


def test_a_flood_of_state_requests_is_deduplicated_and_paced_per_requester():
    s = syncer()
    two_live_learners(s)
    relayed = []
    for i in range(100):
        out = s.receive("c", PeerStateRequest(2, 1), 1.0 + i * 0.01)
        relayed += [(p, m) for p, m in out.send if isinstance(m, PeerStateRequest)]
    assert relayed == [("a", PeerStateRequest(2, 1))]  # one peer asked once
    assert s.handoffs[2].source == 0
    # answered: the next request is still paced by peer_state_interval_s
    s.receive("a", PeerState(2, 0, [], {}), 2.0)
    out = s.receive("c", PeerStateRequest(2, 1), 2.5)
    assert not out.send and out.notes[0].kind == "refused_relay" and "peer_state_interval_s" in out.notes[0].text
    later = 1.0 + RT.peer_state_interval_s + 0.1
    for m, peer in ((0, "a"), (1, "b"), (2, "c")):  # still live
        s.receive(peer, Heartbeat(m, 1, 1, 0.1, 8, 0.1), later)
    out = s.receive("c", PeerStateRequest(2, 1), later)
    assert [m for _, m in out.send] == [PeerStateRequest(2, 1)] and not out.notes


def test_a_request_of_another_incarnation_is_refused():
    s = syncer()
    two_live_learners(s)
    out = s.receive("c", PeerStateRequest(2, 99), 1.0)
    assert not out.send and out.notes[0].kind == "refused_relay"


def test_only_the_chosen_peers_answer_is_relayed_once():
    s = syncer()
    two_live_learners(s)
    state = PeerState(2, 1, [], {"0.exp_avg": torch.zeros(3, 2)})
    out = s.receive("b", state, 1.0)  # nobody asked
    assert not out.send and out.notes[0].kind == "refused_relay" and "nobody asked" in out.notes[0].text
    s.receive("c", PeerStateRequest(2, 1), 1.0)  # relayed to learner 0
    out = s.receive("b", state, 1.1)  # learner 1 was not asked
    assert not out.send and "learner 0 was asked" in out.notes[0].text
    answer = PeerState(2, 0, [], {})
    assert replies(s.receive("a", answer, 1.2), "c") == [answer]
    assert not s.receive("a", answer, 1.3).send  # a second copy is refused


def test_two_rejoiners_are_served_by_different_peers():
    s = syncer()
    two_live_learners(s)
    register(s, 3, "d")
    first = s.receive("c", PeerStateRequest(2, 1), 1.0).send
    second = s.receive("d", PeerStateRequest(3, 1), 1.0).send
    assert first[0][0] != second[0][0]


def test_a_learner_serves_one_request_at_a_time_and_refuses_the_rest_cheaply():
    ln, now = joined_learner(0)
    out = ln.receive(0, PeerStateRequest(5, 1), now)
    assert not out.send
    out = ln.receive(0, PeerStateRequest(6, 1), now)  # one is already queued
    assert [s.msg for s in out.send] == [PeerState(6, 0, [], {})] and out.notes
    assert ln.boundary(now).serve == [5]
    ln.receive(0, PeerStateRequest(7, 1), now + 0.1)  # the burst of 2
    assert ln.boundary(now + 0.1).serve == [7]
    out = ln.receive(0, PeerStateRequest(8, 1), now + 0.2)  # then one per peer_state_interval_s
    assert [s.msg for s in out.send] == [PeerState(8, 0, [], {})]
    assert ln.boundary(now + 0.2).serve == []


def test_a_learner_takes_only_the_answer_to_its_own_pending_request():
    ln, now = joined_learner(0)
    state = PeerState(0, 1, [], {"0.exp_avg": torch.zeros(3, 2)})
    out = ln.receive(0, state, now)
    assert out.notes and ln.boundary(now).peer_state is None  # unsolicited
    ln._awaiting_peer_state = True  # as after its request (complete() sends it once the join is whole)
    assert ln.receive(1, state, now).notes  # not through shard 0
    assert ln.receive(0, PeerState(0, 0, [], {}), now).notes  # from itself
    ln.receive(0, state, now)
    assert ln.boundary(now).peer_state == state
    ln.receive(0, state, now)  # once
    assert ln.boundary(now).peer_state is None


def adamw(steps: int = 3, **kw) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
    return model, opt


def test_an_honest_state_loads_and_the_receivers_hyper_parameters_stay():
    _, giver = adamw(5, weight_decay=0.0)
    _, taker = adamw(0, weight_decay=0.01)
    msg = state_message(giver, 1, 0)
    hostile = PeerState(
        1, 0, [{**g, "weight_decay": 1e6, "lr": 1e3, "eps": 0.0} for g in msg.param_groups], msg.tensors
    )
    assert load_state(taker, hostile, torch.device("cpu")) is None
    group = taker.param_groups[0]
    assert group["weight_decay"] == 0.01 and group["lr"] == 1e-3 and group["eps"] == 1e-8
    got = taker.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], giver.state_dict()["state"][0]["exp_avg"]) and float(got["step"]) == 5


@pytest.mark.parametrize(
    "poison, why",
    [
        (lambda t: {**t, "0.exp_avg": torch.full_like(t["0.exp_avg"], math.nan)}, "non-finite"),
        (lambda t: {**t, "0.exp_avg_sq": torch.full_like(t["0.exp_avg_sq"], math.inf)}, "non-finite"),
        (lambda t: {**t, "0.exp_avg_sq": -t["0.exp_avg_sq"] - 1}, "negative"),
        (lambda t: {**t, "0.exp_avg": t["0.exp_avg"] + 1e30}, "exp_avg exceeds"),
        (lambda t: {**t, "0.exp_avg": torch.zeros(7)}, "shape"),
        (lambda t: {**t, "0.step": torch.tensor(-3.0)}, "step"),
        (lambda t: {**t, "0.step": torch.tensor(2.5)}, "step"),
        (lambda t: {**t, "9.exp_avg": torch.zeros(2)}, "names no parameter"),
        (lambda t: {**t, "x.exp_avg": torch.zeros(2)}, "names no parameter"),
        (lambda t: {**t, "0.evil": torch.zeros(2, 3)}, "different state names"),
        (lambda t: {**t, "0.exp_avg": torch.zeros(2, 3, dtype=torch.int64)}, "dtype"),
    ],
)
def test_a_poisoned_state_is_refused_and_the_optimizer_is_unchanged(poison, why):
    _, giver = adamw(5)
    _, taker = adamw(2)
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in taker.state_dict()["state"].items()}
    msg = state_message(giver, 1, 0)
    problem = load_state(taker, PeerState(1, 0, msg.param_groups, poison(dict(msg.tensors))), torch.device("cpu"))
    assert problem is not None and why in problem
    after = taker.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, st in before.items() for k, v in st.items())


# -- the attacker's side in virtual time -------------------------------------------------------


def simulate(faults):
    from ddiloco.config import load_config
    from ddiloco.methods import PRESETS
    from ddiloco.sim.simulation import Simulation
    from ddiloco.workloads.config import load_workload

    cfg = load_config(None, [*SMALL, "run.method=decoupled"], base=PRESETS["decoupled"])
    sim = Simulation(cfg, load_workload(cfg.workload), faults=faults)
    return sim, sim.run()


def finite(sim) -> bool:
    return all(bool(torch.isfinite(p).all()) for ln in sim.learners for p in ln.params.values())


def test_in_virtual_time_a_request_flood_and_unsolicited_states_cost_the_honest_learners_nothing():
    from ddiloco.sim.faults import Inject

    nan_state = PeerState(0, 2, [{"weight_decay": 1e6}], {"0.exp_avg": torch.full((16, 4), math.nan)})
    sim, _ = simulate(
        [
            Inject(2, PeerStateRequest(2, 0), at_s=5.0, count=500),  # learner 2's key floods requests
            Inject(2, nan_state, at_s=6.0, count=50),  # and pushes a NaN state at learner 0
        ]
    )
    assert sim.invariants() == [] and finite(sim)
    notes = [e for e in sim.log if e["event"] == "syncer_note" and e["kind"] == "refused_relay"]
    assert len(notes) >= 549  # every extra request and every pushed state, with its reason
    served = [e for e in sim.log if e["event"] == "note" and "optimizer state" in e["text"]]
    assert not any("learner 0" in e["text"] and e["learner"] == 0 for e in served if "ignored" in e["text"])
    assert not any(e["event"] == "peer_state" and e["learner"] == 0 for e in sim.log)


@pytest.mark.parametrize("kind", ["nan", "weight_decay", "huge", "shape"])
def test_in_virtual_time_a_rejoiner_refuses_a_hostile_peers_state(kind):
    from ddiloco.sim.faults import HostilePeerState, KillLearner

    # learner 1 dies and rejoins; learners 0 and 2 both serve poison
    sim, _ = simulate(
        [KillLearner(1, at_step=20, restart_after_s=6.0), HostilePeerState(0, kind), HostilePeerState(2, kind)]
    )
    assert sim.invariants() == [] and finite(sim)
    loads = [e for e in sim.log if e["event"] == "peer_state" and e["learner"] == 1]
    assert loads, "the rejoiner was handed a state"
    if kind == "weight_decay":  # the tensors are honest: taken, the hyper-parameters are its own
        assert loads[0]["problem"] is None
        assert sim.learners[1].opt.param_groups[0]["weight_decay"] != 1e6
    else:
        assert all(e["problem"] for e in loads)


# -- real ZeroMQ sockets on loopback, with keys --------------------------------------------------

SETTINGS = [
    "workload.factory=ddiloco.workloads.synthetic:make_workload",
    "workload.options={hidden = 16}",
    "run.num_learners=2",
    "algo.sync_every=8",
    "algo.liveness_timeout_s=2.0",
    "runtime.heartbeat_interval_s=0.1",
    "runtime.syncer_liveness_s=2.0",
    "runtime.status_interval_s=0.5",
    "runtime.backoff_max_s=0.3",
    "runtime.join_timeout_s=5.0",
    "runtime.step_sleep_s=0.01",
]
HOST = "127.0.0.9"


@pytest.fixture()
def keyed_fleet(tmp_path):
    """A keyed syncer on loopback and two keyed learners, as threads."""
    from helpers import keyed_syncer

    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.transport import ZmqLearnerSocket
    from ddiloco.service.learner.process import LearnerProcess

    torch.set_num_threads(1)
    keys = tmp_path / "keys"
    with keyed_syncer(tmp_path / "run", keys, SETTINGS, HOST) as (cfg, addr, service):
        threads, learners = [], []
        for m in range(2):
            k = ClientKeys.load(keys, f"learner-{m}")
            learners.append(LearnerProcess(cfg, [addr], m, tmp_path / "run",
                                           connect=lambda a, i, k=k: ZmqLearnerSocket(a, i, 0.1, 0.3, k)))  # fmt: skip
            threads.append(threading.Thread(target=learners[-1].run, daemon=True))
        for t in threads:
            t.start()
        try:
            yield cfg, addr, keys, service, learners
        finally:
            for ln in learners:
                ln.stop = True
            for t in threads:
                t.join(timeout=30)


def merged_of(service, m: int) -> int:
    """Contributions of learner m merged so far (from the syncer's tape)."""
    from helpers import merges

    return sum(1 for r in merges(service.run_dir) for e in r.merged if e.learner == m and e.was_merged)


def dealer(addr: str, keys, identity: bytes | None = None):
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 2000)
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    keys.apply(s)
    s.connect(addr)
    return s


def test_over_curve_no_other_key_takes_a_learners_route_even_with_its_old_name(keyed_fleet):
    """The attack of the issue: a connection with the observer's key (and one with learner 1's)
    using learner 0's old transport identity, registering and heartbeating as learner 0. Learner
    0 keeps merging; every such message is refused as an impostor; nothing is accepted."""
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.transport import learner_identity
    from ddiloco.service.base.wire import decode, encode
    from ddiloco.training.layout import layout_for, param_spec
    from ddiloco.workloads.config import load_workload

    cfg, addr, keys, service, _ = keyed_fleet
    wait_for(lambda: merged_of(service, 0) >= 2, 120, "learner 0's first merges")
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    reg = Register(0, 2**40, param_spec(model), layout_for(model, wl, cfg.algo).digest)
    # learner 0's old transport identity (one connection may hold a chosen name at a time)
    attackers = [dealer(addr, ClientKeys.load(keys, "observer"), learner_identity(0))]
    attackers.append(dealer(addr, ClientKeys.load(keys, "learner-1")))
    before = merged_of(service, 0)
    replies = []
    try:
        for _ in range(20):
            for s in attackers:
                s.send_multipart(encode(reg))
                s.send_multipart(encode(Heartbeat(0, 2**40, 1, 0.1, 8, 0.1)))
                while s.poll(50):
                    replies.append(decode(s.recv_multipart()))
        wait_for(lambda: merged_of(service, 0) >= before + 3, 120, "learner 0 merging on after the attack")
    finally:
        for s in attackers:
            s.close(0)
    # every message refused and counted: as an impostor, or before decoding by its key's join rate
    assert service.counts["impostor"] >= 20 and service.counts["impostor"] + service.counts["rate_limited"] >= 80
    assert not any(isinstance(r, JoinReply) and r.accepted for r in replies)
    assert not any(isinstance(r, GlobalState) for r in replies)  # and nothing of learner 0's reached them


def test_over_curve_a_learner_whose_connection_changes_under_it_reconnects_and_merges_on(keyed_fleet):
    """A confused learner: its connection is replaced under it (what a dropped TCP connection
    does), so the syncer's route for it leads nowhere and it hears nothing addressed to it. It is
    told (or notices the silence), reconnects on a fresh connection, registers again, merges on."""
    _, _, _, service, learners = keyed_fleet
    wait_for(lambda: merged_of(service, 0) >= 2 and learners[0].learner is not None, 120, "learner 0 merging")
    comm = learners[0].learner.comm
    old_route = service.session.identities[0]
    comm._reconnects.put(0)  # the comm thread drops the connection and opens another
    comm.sock.wake()
    wait_for(lambda: service.session.identities.get(0) not in (None, old_route), 120, "a new route for learner 0")
    before = merged_of(service, 0)
    wait_for(lambda: merged_of(service, 0) >= before + 2, 120, "learner 0 merging on its new connection")
    assert service.counts.get("unknown_sender", 0) >= 1 or comm.reconnects >= 2


def test_over_curve_a_fetch_flood_from_the_observer_key_is_limited_per_key(keyed_fleet):
    """FetchGlobal from one observer key over many connections: the key's limit holds whatever
    connection it uses; refusals are counted."""
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.wire import encode

    _, addr, keys, service, _ = keyed_fleet
    wait_for(lambda: merged_of(service, 0) >= 1, 120, "the first merges")
    observer = ClientKeys.load(keys, "observer")
    socks = [dealer(addr, observer) for _ in range(4)]
    try:
        for _ in range(50):
            for s in socks:
                s.send_multipart(encode(FetchGlobal("flood")))
        wait_for(lambda: service.counts.get("rate_limited", 0) >= 100, 60, "the flood refused")
        before = merged_of(service, 0)
        wait_for(lambda: merged_of(service, 0) >= before + 2, 120, "learner 0 merging on during the flood")
    finally:
        for s in socks:
            s.close(0)


# -- (5) limits per key, charged on receipt before decoding (deterministic) ---------------------


class FrozenClock:
    """A flood arrives within one instant, however busy the machine is."""

    def monotonic(self) -> float:
        return 100.0

    def wall(self) -> float:
        return 1e9


@pytest.fixture()
def keyed_service(tmp_path, monkeypatch):
    """A keyed SyncerService fed by hand (``handle``), its clock frozen and its work clock stepped."""
    from ddiloco.config import load_config
    from ddiloco.service.base.keys import ClientKeys, ServerKeys, make_keys
    from ddiloco.service.base.transport import InProcessNetwork
    from ddiloco.service.syncer import service as syncer_module
    from ddiloco.service.syncer.service import SyncerService

    keys = tmp_path / "keys"
    make_keys(keys, learners=2)
    cfg = load_config(None, SETTINGS)
    service = SyncerService(cfg, InProcessNetwork().syncer("inproc://s"), tmp_path / "run", fsync=False,
                            clock=FrozenClock(), keys=ServerKeys.load(keys))  # fmt: skip
    decoded = []
    real_decode = syncer_module.decode_from
    monkeypatch.setattr(syncer_module, "decode_from", lambda frames, *a: decoded.append(1) or real_decode(frames, *a))
    work = [0.0]

    def work_clock() -> float:  # read twice a message: each "takes" 0.05 s of the syncer's time
        work[0] += 0.05
        return work[0]

    service.work_clock = work_clock
    pub = {name: ClientKeys.load(keys, name).public for name in ("observer", "learner-0", "learner-1")}
    yield service, pub, decoded
    service.stop()
    service.shutdown()


def test_a_flood_from_one_key_over_many_connections_is_cut_by_its_keys_work_share(keyed_service):
    from ddiloco.service.base.wire import encode

    service, pub, decoded = keyed_service
    frames = encode(FetchGlobal("flood"))
    for i in range(500):  # 500 connections of one observer key
        service.handle(b"conn-%d" % i, frames, pub["observer"])
    # a burst of 1 s of work at 0.05 s a message, then nothing: the rest dropped before decoding
    assert len(decoded) <= 21 and service.counts["rate_limited"] >= 479
    # another key is untouched by the flood
    n = len(decoded)
    service.handle(b"other", encode(FetchGlobal("evaluator")), pub["learner-1"])
    assert len(decoded) == n + 1


def test_registrations_are_not_charged_to_the_keys_work_share(keyed_service):
    """A registration is bounded by the join rate, not the work share: a restarted learner's
    catch-up (sent as its registration is answered) must not cost it the answers that follow."""
    from ddiloco.protocol.messages import SettingsRequest
    from ddiloco.service.base.wire import encode

    service, pub, decoded = keyed_service
    for i in range(10):  # the join rate's burst, each "taking" the syncer's time
        service.handle(b"learner-0", encode(SettingsRequest(0, i + 1)), pub["learner-0"])
    assert len(decoded) == 10  # (charged, 10 x 0.15 s would have passed the 1 s burst already)
    for _ in range(15):  # then 0.75 s of its other messages: within the work share's burst
        service.handle(b"learner-0", [b"x"], pub["learner-0"])
    assert len(decoded) == 25 and service.counts["malformed"] == 15 and service.counts["rate_limited"] == 0


def test_the_message_rate_is_per_key_and_a_fetch_burst_is_refused_with_a_reason(keyed_service):
    from ddiloco.service.base.wire import encode

    service, pub, decoded = keyed_service
    service._busy = None  # only the session's read limit: 10 answered, the rest refused with a note
    frames = encode(FetchGlobal("flood"))
    for i in range(30):
        service.handle(b"conn-%d" % i, frames, pub["observer"])
    assert service.counts["rate_limited"] == 20 and len(decoded) == 30
    for _ in range(5000):  # the per-key message rate (2000/s, bursts of 4000): charged before decoding
        service.handle(b"c", [b"x"], pub["learner-0"])
    assert len(decoded) == 30 + 4000 and service.counts["rate_limited"] == 20 + 1000
    assert service.counts["malformed"] == 4000


def test_without_keys_a_restarted_learner_connects_beside_its_predecessor_and_rejoins(tmp_path):
    """No handover any more: a new process of learner 1 gets a connection of its own (its
    predecessor's may still be open) and registers; the syncer routes learner 1 to it."""
    from ddiloco.config import load_config
    from ddiloco.service.base.transport import ZmqLearnerSocket, ZmqSyncerSocket
    from ddiloco.service.learner.process import LearnerProcess
    from ddiloco.service.ops.launcher import free_port
    from ddiloco.service.syncer.service import SyncerService

    torch.set_num_threads(1)
    cfg = load_config(None, SETTINGS)
    addr = f"tcp://{HOST}:{free_port(HOST)}"
    service = SyncerService(cfg, ZmqSyncerSocket(addr), tmp_path / "run", fsync=False)
    connect = lambda a, i: ZmqLearnerSocket(a, i, 0.1, 0.3)  # noqa: E731
    learners = [LearnerProcess(cfg, [addr], m, tmp_path / "run", connect=connect) for m in (0, 1)]
    threads = [threading.Thread(target=t, daemon=True) for t in (service.serve, *(ln.run for ln in learners))]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: merged_of(service, 1) >= 1, 120, "learner 1's first merge")
        learners[1].stop = True
        threads[2].join(timeout=60)
        new = LearnerProcess(cfg, [addr], 1, tmp_path / "run", connect=connect, incarnation=learners[1].incarnation + 1)
        learners.append(new)
        threads.append(threading.Thread(target=new.run, daemon=True))
        threads[-1].start()

        def merged_new() -> bool:
            from helpers import merges

            return any(
                e.learner == 1 and e.incarnation == new.incarnation for r in merges(service.run_dir) for e in r.merged
            )

        wait_for(merged_new, 120, "the new process of learner 1 merged")
    finally:
        for ln in learners:
            ln.stop = True
        service.stop()
        for t in threads:
            t.join(timeout=30)


# -- (issue 34, item 2) no counter an insider can inflate to end or skew the run -----------------


def honest_heartbeats(s: SyncerSession, peers, t: float, claims) -> list:
    notes = []
    for m, peer in enumerate(peers):
        hb = Heartbeat(m, 1, step=int(t * 10), step_time_s=0.1, tokens=int(claims[m]))
        notes += s.receive(peer, hb, t).notes
    return notes


def test_a_heartbeat_claiming_the_counters_maximum_is_refused_counted_and_the_run_goes_on():
    """Three learners at 1,000 tokens a second against a budget of 1,000,000; at 10 s learner 2
    claims 2^53 tokens (what ended a run for good before). The claim is believed only within
    its bucket (the spread x the others' median rate, one liveness window of it), one
    "implausible" note says so, the run goes on, and the honest learners count in full."""
    s = syncer()
    s.budget = Budget(processed_tokens=1_000_000)
    peers = ("a", "b", "c")
    for m, peer in enumerate(peers):
        register(s, m, peer)
    notes = []
    for k in range(1, 41):
        t = 0.5 * k
        claims = [1000.0 * t] * 3
        if k == 20:
            claims[2] = 2**53
        notes += honest_heartbeats(s, peers, t, claims)
    assert s.end_stage is None
    implausible = [n for n in notes if n.kind == "implausible"]
    assert len(implausible) == 1 and "learner 2" in implausible[0].text, implausible
    assert s.fleet.progress[0].tokens == s.fleet.progress[1].tokens == 20_000
    window = RT.token_rate_spread * 1000.0 * (CFG.liveness_timeout_s + 0.5)
    assert 20_000 <= s.fleet.progress[2].tokens <= 20_000 + window
    assert s.fleet.refused_tokens >= 2**53 - 30_000
    assert s.fleet.processed_tokens() <= 60_000 + window


def test_heartbeats_held_by_a_slow_link_count_in_full_when_they_arrive_together():
    """A partition holds learner 0's heartbeats for 5 s (within the liveness window), then ten
    arrive at once: every token counts, nothing is refused."""
    book = FleetBook(token_rate_spread=4.0, lone_tokens_per_s=1e6, window_s=10.0)
    live = {0, 1}
    for m in live:
        book.restarted(m, 1, 0.0)
    t = 0.0
    for k in range(1, 21):  # 10 s of steady heartbeats from both
        t = 0.5 * k
        for m in live:
            book.heartbeat(Heartbeat(m, 1, k, 0.1, tokens=1000 * k), t, book.rate_cap(m, lambda: live, t))
    for k in range(21, 31):  # learner 1 on time; learner 0's are held until 15 s, then all land
        book.heartbeat(Heartbeat(1, 1, k, 0.1, tokens=1000 * k), 0.5 * k, book.rate_cap(1, lambda: live, 0.5 * k))
    for k in range(21, 31):
        book.heartbeat(Heartbeat(0, 1, k, 0.1, tokens=1000 * k), 15.0, book.rate_cap(0, lambda: live, 15.0))
    assert book.refused_tokens == 0
    assert book.processed_tokens() == 2 * 30_000


def test_a_restarted_syncer_counts_on_from_the_tokens_it_took_back():
    before = FleetBook()
    before.restarted(0, 3, 0.0)
    before.heartbeat(Heartbeat(0, 3, 100, 0.1, tokens=500_000), 1.0, 1e6)
    after = FleetBook(lone_tokens_per_s=1000.0, window_s=2.0)
    after.load_state(before.state())
    after.restarted(0, 3, 49.0)  # it registers again with the new process
    # Its first heartbeat to the new process is cumulative: only what grew is new, and it fits.
    assert after.heartbeat(Heartbeat(0, 3, 101, 0.1, tokens=500_900), 50.0, after.rate_cap(0, lambda: {0}, 50.0)) == 0
    assert after.processed_tokens() == 500_900


def test_a_learner_far_faster_than_the_spread_allows_is_undercounted_and_said_so():
    """The documented cost of the cap: a learner 8x the others' median rate (spread 4) is
    counted at about 4x, its claims beyond refused (raise runtime.token_rate_spread for such a
    fleet)."""
    book = FleetBook(token_rate_spread=4.0, window_s=2.0)
    live = {0, 1, 2}
    for m in live:
        book.restarted(m, 1, 0.0)
    refused = 0.0
    for k in range(1, 81):
        t = 0.5 * k
        for m, rate in ((0, 1000), (1, 1000), (2, 8000)):
            cap = book.rate_cap(m, lambda: live, t)
            refused += book.heartbeat(Heartbeat(m, 1, k, 0.1, tokens=rate * k // 2), t, cap)
    counted = book.progress[2].tokens
    assert refused > 0 and 3.5 * 1000 * 40 <= counted <= 4.5 * 1000 * 40 + 8000, counted


@pytest.mark.parametrize("what", ["contribution", "registration"])
def test_a_contribution_or_registration_with_its_counters_at_their_maximum_leaves_the_run_going(what):
    """Every counter a keyed learner sends at the wire's maximum: the claim is refused (and
    counted) or only concerns the sender; the run's budget, clock and merged count do not move."""
    s = syncer()
    s.budget = Budget(processed_tokens=1_000_000, merged_tokens=1_000_000)
    for m, peer in enumerate(("a", "b", "c")):
        register(s, m, peer)
        s.receive(peer, Heartbeat(m, 1, 0, 0.1), 0.5)
    if what == "contribution":
        top = 2**53
        values = [torch.zeros(pc.shape) for pc in LAYOUT.fragments[0]]
        c = Contribution(0, 1, 0, 0, 2**63 - 1, values, top, top, top, top)
        tape = s.receive("a", c, 1.0).tape + s.tick(30.0).tape
        (entry,) = [e for r in tape for e in getattr(r, "merged", []) if e.learner == 0]
        assert entry.clipped and entry.tokens == 0 and entry.weight == 0.0  # its claim counts nothing
    else:
        out = s.receive("d", Register(3, 2**63 - 1, PARAMS, REGISTRATION.layout, pid=2**31 - 1), 1.0)
        assert any(isinstance(m, JoinReply) and m.accepted for _, m in out.send)  # its own id, nobody else's
        s.receive("d", Heartbeat(3, 2**63 - 1, 2**53, 86400.0, tokens=2**53, busy_s=1e10), 1.5)
    s.tick(31.0)
    assert s.end_stage is None
    assert s.fleet.processed_tokens() < 1_000_000 and s.core.merged_tokens < 1_000_000


RATE_SETS = [[5.0], [1.0, 9.0], [3.0, 3.0, 3.0], [1.0, 2.0, 3.0, 400.0], [7.0, 1.0, 7.0, 2.0, 9.0]]


@pytest.mark.parametrize("rates", RATE_SETS)
def test_the_cap_is_the_upper_median_of_the_other_live_learners_rates(rates):
    """The cap a heartbeat is judged by (sorted once per refresh, a bisection per heartbeat) is
    the spread times the upper median of the *other* live learners' claimed rates; a learner
    that is not live does not count."""
    import statistics

    book = FleetBook(token_rate_spread=2.0, lone_tokens_per_s=77.0)
    n = len(rates)
    for m in range(n + 1):  # learner n is registered and reports, but is not live
        book.restarted(m, 1, 0.0)
        book.heartbeat(Heartbeat(m, 1, 1, 0.1, tokens=1), 1.0)
    for m in range(n + 1):
        book.heartbeat(Heartbeat(m, 1, 2, 0.1, tokens=1 + int(10 * (rates + [1e6])[m])), 11.0)
    live = set(range(n))
    for m in range(n + 1):
        others = [r for i, r in enumerate(rates) if i != m]
        want = 2.0 * statistics.median_high(others) if others else 77.0
        assert book.rate_cap(m, lambda: live, 11.0) == pytest.approx(want), (m, rates)


def test_the_budget_is_overshot_by_at_most_one_learners_window_when_a_held_link_lands():
    """Three learners at 1,000 tokens a second, a budget of 40,000: learner 0's heartbeats are
    held for the liveness window just before the budget is reached, then land (cumulative).
    The run ends on them, past the budget by at most one learner's window of tokens (and, with
    learner 2 an insider claiming 2^53 from its first heartbeat, by at most its capped window)."""
    window_s = CFG.liveness_timeout_s
    for insider in (False, True):
        s = syncer()
        s.budget = Budget(processed_tokens=40_000)
        peers = ("a", "b", "c")
        for m, peer in enumerate(peers):
            register(s, m, peer)
        # it lands at 13.5 s, the fleet at 38,500 then: its window's tokens end the run
        held_from, k = 13.5 - window_s, 0
        while s.end_stage is None and k < 400:
            k += 1
            t = 0.25 * k
            for m, peer in enumerate(peers):
                if m == 0 and held_from <= t < held_from + window_s:
                    continue  # held by the link
                claim = 1000.0 * t if not (insider and m == 2) else 2**53
                s.receive(peer, Heartbeat(m, 1, step=k, step_time_s=0.1, tokens=int(claim)), t)
            s.tick(t)
        assert s.end_stage is not None, "the budget ended the run"
        over = s.processed_tokens() - 40_000
        one_window = (RT.token_rate_spread if insider else 1.0) * 1000.0 * (window_s + 0.5)
        assert 0 <= over <= one_window, (insider, over, one_window)
        if not insider:
            assert t == held_from + window_s, (t, over)  # the landing ended it


def test_a_run_ended_by_a_count_nobody_vouched_for_goes_on_when_restarted_and_says_why():
    """A restart on a run that ended: the store's counts are audited. Learner 2's 2^53 (what an
    older syncer believed from one heartbeat) is lowered to the spread x the others' median, the
    budget is no longer spent, and one line says why it stopped and that it goes on; an end
    reached by honest counts stands."""
    budget = Budget(processed_tokens=400_000)
    reason = "9,007,199,254,743,192 tokens processed by the fleet, the budget is 400,000 (run.processed_tokens)"
    s = syncer(budget=budget, ended=reason)
    s.fleet.load_state({"best": [[0, 1, 1000], [1, 1, 1200], [2, 1, 2**53]]})
    s.ended_at(2.0**53 + 2200)
    line = s.reopen(5.0)
    assert line is not None and reason in line and "learner 2 claimed 9,007,199,254,740,992" in line
    assert "the run goes on" in line and "\n" not in line
    assert s.end_stage is None and s.processed_tokens() == 1000 + 1200 + RT.token_rate_spread * 1200
    register(s, 0, "a", 6.0)
    assert s.fleet.progress[0].tokens == 1000  # its incarnation's count, as before
    honest = syncer(budget=budget, ended="400,001 tokens processed")
    honest.fleet.load_state({"best": [[0, 1, 200_000], [1, 1, 200_001]]})
    assert honest.reopen(5.0) is None and honest.end_stage == "done"
    capped = syncer(budget=budget, ended=reason)  # clipped, but still past the budget: the end stands
    capped.fleet.load_state({"best": [[0, 1, 150_000], [1, 1, 150_000], [2, 1, 2**53]]})
    assert capped.reopen(5.0) is None and capped.end_stage == "done"
