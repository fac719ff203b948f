"""The soak benchmark's insider phase (issue 18): one keyed attacker among 4 learners.

    python bench/soak.py --insider                         # 6 arms x 3 repetitions (~45 min)
    python bench/soak.py --insider --insider-s 60 --reps 1 # a first look (~15 min)

Every run: a syncer and learners over CURVE on loopback (the soak's synthetic settings, 4
data shards), of equal length, with no kills; repetition r uses run.seed = r in every arm.
Learners 0-2 are honest ``ddiloco learner`` processes. Learner 3 is, per arm:

- ``baseline``: absent (the fleet without the attacker: what the honest learners reach alone,
  as in the soak's baseline; an attack must not make the run worse than its absence);
- ``reverse_capped``: a real learner whose contributions are rewritten on the wire: its delta
  reversed, and its tokens doubled (4x its weight: the weight cap's size);
- ``drift``: its delta plus a fixed direction of 2.5x the delta's norm, every round (just
  under the robust merge's size bound of 3x the round's median);
- ``reverse``: its delta reversed, at its own (honest) norm and weight;
- ``inflate``: its tokens x10 every round (weight x100);
- ``protocol``: learner 3's key is held by a protocol attacker (no training) that lies about
  its step time (the largest allowed), floods PeerStateRequests (200/s), pushes unsolicited
  PeerStates with NaN moments and absurd hyper-parameters to learners 0-2, answers rounds
  from a stale base and floods stale contributions (20/s); an observer-key process floods
  FetchGlobal (200/s) and tries to take learner 0's route (its transport name, Register as 0).

Measured per run: the final global model's eval loss, honest merges per minute (learners 0-2
only, so every arm counts the same learners), refusals by reason (tape) and the syncer's
counts (impostor, unknown_sender, rate_limited, refused_relay...), NaN in any learner's
loss, honest learners cut off (no merge in the run's second half), invariant violations
(``report.invariants.check_run``). Each run's result is cached in WORK/<arm>-<rep>.json, so an
interrupted benchmark resumes. Writes docs/results/insider.md and .json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_setup as soak  # noqa: E402  (the soak's settings, shared with bench/soak.py)
from harness.cells import cached_runs  # noqa: E402
from harness.cluster import Cluster  # noqa: E402  (bench/harness, beside this script)
from harness.files import TapeReader  # noqa: E402
from harness.paths import ENV, sets  # noqa: E402
from harness.tables import facts, publish  # noqa: E402

ARMS = (
    "baseline", "reverse_capped", "drift", "reverse", "inflate", "protocol",
    "adaptive", "adaptive_off", "adapted", "baseline8", "collude8", "adapted8", "baseline5", "collude5",
)  # fmt: skip
INFLUENCE = ("reverse_capped", "drift", "reverse", "inflate", "adaptive", "adaptive_off", "adapted")
ADAPTIVE = ("adaptive", "adaptive_off", "adapted", "collude8", "adapted8", "collude5")
SHAPES = {  # arm -> (honest learners, attackers, the attack, the attacker-free run of its shape)
    **{a: (3, 1, a, "baseline") for a in ("reverse_capped", "drift", "reverse", "inflate", "protocol")},
    "baseline": (3, 0, "", "baseline"),
    "adaptive": (3, 1, "adaptive", "baseline"),
    "adaptive_off": (3, 1, "adaptive", "baseline"),  # the same attack, the drift history off
    "adapted": (3, 1, "adapted", "baseline"),
    "baseline8": (6, 0, "", "baseline8"),
    "collude8": (6, 2, "adaptive", "baseline8"),
    "adapted8": (6, 2, "adapted", "baseline8"),
    "baseline5": (3, 0, "", "baseline5"),
    "collude5": (3, 2, "adaptive", "baseline5"),
}
EXTRA = {"adaptive_off": ["algo.robust_drift_limit=0"]}
"""Per arm, settings beyond the soak's (the drift-off arm: the merge as it was before the drift
history, to show the attack is as strong as the one measured then)."""
MUST_HOLD = ("reverse_capped", "drift", "reverse", "inflate", "adaptive", "collude8")
"""Arms whose loss must stay within ``TARGET_LOSS_RATIO`` of their shape's baseline; the others
(two colluders of five, the attacker adapted to the drift rule, the drift history off) are
reported."""
ADAPTIVE_SIZE = 2.8
"""The adaptive insider's |delta| over its honest one (issue 34's measurement)."""
ADAPTIVE_COSINE = 0.76
"""Its cosine with its own honest delta (about its alignment with the round's centre)."""
ADAPTIVE_TOKENS = 1.4
"""Its token claim over its honest one."""
ROTATION = 0.05
"""The adapted attacker's turn of its push direction per answer (radians): slow against the
drift history's memory of about 10 answers."""
TARGET_LOSS_RATIO = 1.05
TARGET_FLOOD_RATE = 0.8
FLOOD_PER_S = 200


def settings(rep: int, arm: str = "baseline") -> list[str]:
    honest, attackers, _, _ = SHAPES[arm]
    fleet = max(4, honest + attackers)  # the 4-learner arms keep the soak's 4 data shards
    drift = EXTRA.get(arm, ["algo.robust_drift_limit=3"])  # (the drift history is off by default)
    return [*soak.SETTINGS, f"run.seed={rep}", f"run.num_learners={fleet}", *drift]


def attackers_of(arm: str) -> list[int]:
    honest, attackers, _, _ = SHAPES[arm]
    return list(range(honest, honest + attackers))


# -- the tampering learner (a real learner process whose contributions are rewritten) -------------


def tampering_learner_main(kind: str, argv: list[str]) -> int:
    """Run ``ddiloco learner`` in this process, rewriting its contributions as ``kind`` says
    (the wire's encode and decode, as the comm thread uses them, are wrapped)."""
    import torch

    import ddiloco.service.learner.comm as comm
    from ddiloco.cli import main as cli_main
    from ddiloco.core.messages import Contribution, FragmentUpdate

    bases: dict[tuple[int, int], list[torch.Tensor]] = {}
    directions: dict[int, list[torch.Tensor]] = {}
    turns: dict[int, int] = {}  # per fragment, the adapted attacker's answers so far
    control = Controller(os.environ.get("DDILOCO_INSIDER_TAPE", ""), os.environ.get("DDILOCO_INSIDER_HONEST", ""))
    from ddiloco.training.layout import layout_for
    from ddiloco.workloads.config import load_workload

    cfg = soak.load_cfg()
    wl = load_workload(cfg.workload)
    # Per fragment, which pieces are parameters: the attacks move those and leave the buffers
    # (running statistics: hostile buffers are the protocol arm's and test_soak's).
    fragments = layout_for(wl.build_model(0), wl, cfg.algo).fragments.fragments
    is_param = [[pc.kind == "param" for pc in f] for f in fragments]
    decode, encode = comm.decode, comm.encode
    counts = {"rewritten": 0, "untouched": 0}

    def watch(frames: Any) -> Any:
        msg = decode(frames)
        if isinstance(msg, FragmentUpdate):  # the versions its answers will be anchored at
            bases[(msg.fragment, msg.version)] = [v.detach().clone() for v in msg.values]
            for key in [k for k in bases if k[0] == msg.fragment and k[1] < msg.version - 8]:
                del bases[key]
        return msg

    def rewrite(msg: Any) -> Any:
        # A contribution carries its values, or (fp32 up-link, since the learner sends what
        # moved) its delta itself: the attack rewrites the delta either way.
        if isinstance(msg, Contribution) and msg.steps > 0 and msg.kind in ("values", "delta"):
            base = bases.get((msg.fragment, msg.base_version))
            if base is None and msg.kind == "values":
                counts["untouched"] += 1
            else:
                counts["rewritten"] += 1
                delta = list(msg.values) if msg.kind == "delta" else [b - v for b, v in zip(base, msg.values)]
                moved = [i for i, own in enumerate(is_param[msg.fragment]) if own]
                attacked, tokens = tamper(kind, msg, [delta[i] for i in moved])
                new_delta = list(delta)
                for i, t in zip(moved, attacked):
                    new_delta[i] = t
                values = new_delta if msg.kind == "delta" else [b - d for b, d in zip(base, new_delta)]
                msg = dataclasses.replace(msg, values=values, tokens=tokens)
                if counts["rewritten"] % 50 == 1:
                    print(f"insider {kind}: {counts}", flush=True)
        return encode(msg)

    def tamper(kind: str, msg: Any, delta: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """The attacked delta and token claim of one contribution of honest ``delta``."""
        if kind in ("reverse", "reverse_capped"):
            return [-d for d in delta], msg.tokens * 2 if kind == "reverse_capped" else msg.tokens
        if kind == "drift":
            if msg.fragment not in directions:
                g = torch.Generator().manual_seed(1000 + msg.fragment)
                rand = [torch.randn(d.shape, generator=g) for d in delta]
                size = math.sqrt(sum(float(r.norm()) ** 2 for r in rand))
                directions[msg.fragment] = [r / size for r in rand]
            norm = math.sqrt(sum(float(d.norm()) ** 2 for d in delta))
            return [d + 2.5 * norm * u for d, u in zip(delta, directions[msg.fragment])], msg.tokens
        if kind == "inflate":
            return delta, msg.tokens * 10
        if kind in ("adaptive", "adapted"):
            return adaptive(msg, delta, kind == "adapted"), int(msg.tokens * ADAPTIVE_TOKENS)
        raise ValueError(kind)

    def unit_directions(fragment: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Two fixed random directions per fragment (the same seed in every colluder)."""
        if fragment not in directions:
            g = torch.Generator().manual_seed(1000 + fragment)
            directions[fragment] = [torch.randn(v.shape, generator=g) for v in values for _ in range(2)]
        return directions[fragment]

    def adaptive(msg: Any, delta: list[torch.Tensor], adapted: bool) -> list[torch.Tensor]:
        """Its honest delta d turned into |d| (a u + b p): u = d's direction, p a fixed
        direction made orthogonal to u, |a u + b p| = ADAPTIVE_SIZE, cos(., u) =
        ADAPTIVE_COSINE. Adapted: p turns slowly (ROTATION per answer), and the push and the
        excess size shrink by the controller's factor, which holds the attacker's drift at the
        honest 90th percentile."""
        pair = unit_directions(msg.fragment, delta)
        first, second = pair[0::2], pair[1::2]
        k = turns[msg.fragment] = turns.get(msg.fragment, 0) + 1
        angle = ROTATION * k if adapted else 0.0
        push = [math.cos(angle) * f + math.sin(angle) * g for f, g in zip(first, second)]
        d_norm = math.sqrt(sum(float(d.norm()) ** 2 for d in delta))
        if d_norm <= 0:
            return delta
        u = [d / d_norm for d in delta]
        along = sum(float((pp * uu).sum()) for pp, uu in zip(push, u))
        ortho = [pp - along * uu for pp, uu in zip(push, u)]
        o_norm = math.sqrt(sum(float(o.norm()) ** 2 for o in ortho)) or 1.0
        # The whole attack scales with the controller's factor f: its push (b) and its excess size
        # along its own direction (a - 1), which would repeat its own residual a times over.
        f = control.scale() if adapted else 1.0
        b = ADAPTIVE_SIZE * math.sqrt(1 - ADAPTIVE_COSINE**2) * f
        a = 1.0 + (ADAPTIVE_SIZE * ADAPTIVE_COSINE - 1.0) * f
        return [d_norm * (a * uu + b * oo / o_norm) for uu, oo in zip(u, ortho)]

    comm.decode, comm.encode = watch, rewrite
    return cli_main(argv)


class Controller:
    """The adapted attacker's knowledge of the rule: it reads the tape (what an insider who
    reads the syncer's code could estimate from its own answers) and keeps its drift at the
    honest learners' 90th percentile by scaling its push: down when above, up slowly below."""

    def __init__(self, tape: str, honest: str) -> None:
        self.path = Path(tape) if tape else None
        self.honest = {int(m) for m in honest.split(",") if m}
        self.at, self.offset, self.factor = 0.0, 0, 1.0
        self.own: list[float] = []
        self.others: list[float] = []

    def scale(self) -> float:
        now = time.monotonic()
        if self.path is None or now - self.at < 1.0:
            return self.factor
        if not self.path.exists():  # (the tape is in the run folder, or in its state folder)
            other = self.path.parent.parent / self.path.name if self.path.parent.name == "state" else None
            if other is None or not other.exists():
                return self.factor
            self.path = other
        self.at = now
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        cut = chunk.rfind(b"\n") + 1
        self.offset += cut
        for line in chunk[:cut].splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            for e in r.get("merged", []) if r.get("event") == "round" else []:
                if e.get("drift", 0) > 0:
                    (self.others if e["learner"] in self.honest else self.own).append(float(e["drift"]))
        self.own, self.others = self.own[-10:], self.others[-300:]
        if len(self.own) >= 3 and len(self.others) >= 10:
            target = sorted(self.others)[int(0.9 * (len(self.others) - 1))]
            mine = statistics.median(self.own)
            self.factor = min(1.0, max(0.01, self.factor * (0.8 if mine > target else 1.05)))
        return self.factor


# -- the protocol attackers ------------------------------------------------------------------------


def protocol_attacker_main(addr: str, keys: str, until: float, run_dir: str) -> int:
    """Learner 3's key, no training: step-time lies, request and stale floods, pushed states."""
    import torch
    import zmq

    torch.set_num_threads(1)
    from ddiloco.core.messages import Contribution, FragmentRequest, FragmentUpdate, Heartbeat
    from ddiloco.protocol.messages import JoinReply, PeerState, PeerStateRequest, Register, SyncerHeartbeat
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.wire import WireError, decode, encode
    from ddiloco.training.layout import layout_for, param_spec
    from ddiloco.workloads.config import load_workload

    cfg = soak.load_cfg()
    wl = load_workload(cfg.workload)
    model = wl.build_model(0)
    layout, spec = layout_for(model, wl, cfg.algo), param_spec(model)
    me, inc = soak.ATTACKER, time.time_ns() // 1000
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    ClientKeys.load(keys, f"learner-{me}").apply(sock)
    sock.connect(addr)
    stale: dict[int, tuple[int, list[torch.Tensor]]] = {}  # the first version it got of each fragment
    sent = {"heartbeat_lies": 0, "state_requests": 0, "pushed_states": 0, "stale_answers": 0, "stale_flood": 0}
    got = {"stale_updates": 0, "join_replies": 0}
    seq, last, registered_at = 0, dict.fromkeys(("hb", "flood", "push"), 0.0), 0.0
    poison = {"0.exp_avg": torch.full((4,), float("nan")), "0.exp_avg_sq": torch.full((4,), 1e30)}
    groups = [{"lr": 1e9, "weight_decay": 1e9, "betas": [0.0, 0.0], "eps": 0.0, "params": [0]}]

    def register() -> None:
        nonlocal registered_at
        registered_at = time.monotonic()
        sock.send_multipart(encode(Register(me, inc, spec, layout.digest, [], os.getpid())))

    def stale_answer() -> None:
        nonlocal seq
        if not stale:
            return
        p = list(stale)[seq % len(stale)]
        version, values = stale[p]
        seq += 1
        tokens = cfg.algo.sync_every * cfg.workload.batch_size
        sock.send_multipart(encode(Contribution(me, inc, p, version, seq, values, cfg.algo.sync_every, tokens, 0, 0)))

    register()
    while time.time() < until:
        now = time.monotonic()
        while sock.poll(5):
            try:
                msg = decode(sock.recv_multipart())
            except WireError:
                continue
            if isinstance(msg, JoinReply):
                got["join_replies"] += 1
            elif isinstance(msg, FragmentUpdate):
                if msg.fragment in stale:
                    got["stale_updates"] += msg.reason == "stale"
                else:
                    stale[msg.fragment] = (msg.version, [v.clone() for v in msg.values])
            elif isinstance(msg, FragmentRequest):
                stale_answer()
                sent["stale_answers"] += 1
            elif isinstance(msg, SyncerHeartbeat) and (not msg.bound) and now - registered_at > 2.0:
                register()
        if now - last["hb"] >= 0.25:  # the largest step time the syncer accepts
            last["hb"] = now
            sock.send_multipart(encode(Heartbeat(me, inc, 10**6, cfg.algo.max_step_time_s)))
            sent["heartbeat_lies"] += 1
        if now - last["flood"] >= 0.1:
            last["flood"] = now
            for _ in range(FLOOD_PER_S // 10):
                sock.send_multipart(encode(PeerStateRequest(me, inc)))
            sent["state_requests"] += FLOOD_PER_S // 10
            for _ in range(2):
                stale_answer()
            sent["stale_flood"] += 2
        if now - last["push"] >= 0.5:
            last["push"] = now
            for m in soak.HONEST:
                sock.send_multipart(encode(PeerState(m, me, groups, poison)))
            sent["pushed_states"] += len(soak.HONEST)
    Path(run_dir, "protocol_attacker.json").write_text(json.dumps({"sent": sent, "got": got}))
    sock.close(0)
    return 0


def observer_attacker_main(addr: str, keys: str, until: float, run_dir: str) -> int:
    """The observer's key: a FetchGlobal flood, and a try at learner 0's route (its old
    transport name, and Register as learner 0)."""
    import torch
    import zmq

    torch.set_num_threads(1)
    from ddiloco.protocol.messages import FetchGlobal, GlobalState, Register
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.transport import learner_identity
    from ddiloco.service.base.wire import WireError, decode, encode
    from ddiloco.training.layout import layout_for, param_spec
    from ddiloco.workloads.config import load_workload

    cfg = soak.load_cfg()
    wl = load_workload(cfg.workload)
    model = wl.build_model(0)
    layout, spec = layout_for(model, wl, cfg.algo), param_spec(model)
    ctx = zmq.Context.instance()
    flood = ctx.socket(zmq.DEALER)
    thief = ctx.socket(zmq.DEALER)
    thief.setsockopt(zmq.IDENTITY, learner_identity(0))  # learner 0's old transport name
    for s in (flood, thief):
        s.setsockopt(zmq.LINGER, 0)
        ClientKeys.load(keys, "observer").apply(s)
        s.connect(addr)
    sent = {"fetches": 0, "takeovers": 0}
    got = {"global_states": 0, "thief_replies": 0}
    last_flood = last_take = 0.0
    while time.time() < until:
        now = time.monotonic()
        if now - last_flood >= 0.05:
            last_flood = now
            for _ in range(FLOOD_PER_S // 20):
                flood.send_multipart(encode(FetchGlobal("insider")), flags=zmq.NOBLOCK)
            sent["fetches"] += FLOOD_PER_S // 20
        if now - last_take >= 1.0:
            last_take = now
            thief.send_multipart(encode(Register(0, time.time_ns() // 1000, spec, layout.digest, [], os.getpid())))
            sent["takeovers"] += 1
        for s, key in ((flood, "global_states"), (thief, "thief_replies")):
            while s.poll(1):
                try:
                    msg = decode(s.recv_multipart())
                except WireError:
                    continue
                got[key] += 1 if key == "thief_replies" or isinstance(msg, GlobalState) else 0
        time.sleep(0.005)
    Path(run_dir, "observer_attacker.json").write_text(json.dumps({"sent": sent, "got": got}))
    for s in (flood, thief):
        s.close(0)
    return 0


# -- one run -------------------------------------------------------------------------------------


def run_one(work: Path, arm: str, rep: int, duration_s: float) -> dict[str, Any]:
    from ddiloco.core.tape import RoundRecord, parse_tape_record
    from ddiloco.report.invariants import check_run
    from ddiloco.service.base.keys import make_keys

    run_dir = work / f"{arm}-{rep}"
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    keys = work / "keys"
    make_keys(keys, learners=8)
    honest_n, _, attack, _ = SHAPES[arm]
    honest, attackers = list(range(honest_n)), attackers_of(arm)
    c = Cluster(run_dir, sets(settings(rep, arm)), keys=keys)
    c.syncer()

    deadline = time.time() + 300
    while not c.status("syncer-0") and time.time() < deadline:
        time.sleep(0.1)
    for m in honest:
        c.learner(m, threads=1)
    if attack in (*INFLUENCE, *ADAPTIVE):  # real learner processes of this file, contributions rewritten
        # (the cluster starts its processes in the harness's environment, ENV, not this one's)
        ENV["DDILOCO_INSIDER_TAPE"] = str(run_dir / "state" / "tape.jsonl")
        ENV["DDILOCO_INSIDER_HONEST"] = ",".join(map(str, honest))
        for m in attackers:
            tampering = [sys.executable, __file__, "--tampering-learner", attack, "--", *c.learner_args(m, threads=1)]
            c.start(f"learner-{m}", [*tampering, *c.extra])
    starters = [*honest, *(attackers if attack != "protocol" else [])]
    deadline = time.time() + 300
    while not all(c.status(f"learner-{m}").get("steps", 0) > 0 for m in starters) and time.time() < deadline:
        time.sleep(0.2)
    t0 = c.t0_wall = time.time()
    end = t0 + duration_s
    if arm == "protocol":
        for role in ("protocol-attacker", "observer-attacker"):
            c.start(role, [sys.executable, __file__, f"--{role}", c.addr, str(keys), f"{end:.3f}", str(run_dir)])
    everyone = [*honest, *attackers]
    losses: dict[int, list[float]] = {m: [] for m in everyone}
    while time.time() < end:
        for m in everyone:
            loss = c.status(f"learner-{m}").get("loss")
            if isinstance(loss, (int, float)):
                losses[m].append(float(loss))
        time.sleep(1.0)
    wall = time.time() - t0
    for role in ("protocol-attacker", "observer-attacker"):
        if role in c.procs:
            try:
                c.procs[role].wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.kill(role)
    st = c.status("syncer-0")
    for m in attackers:  # first: the run's end is no time alone with the fleet
        if f"learner-{m}" in c.procs and c.alive(f"learner-{m}"):
            c.kill(f"learner-{m}", signal.SIGTERM)
    c.stop()
    eval_loss = final_eval_loss(run_dir, rep, arm)
    records = TapeReader(run_dir / "state" / "tape.jsonl")
    records.poll()
    rounds = [r for r in records.records if r.get("event") == "round"]

    def t_of(r: dict[str, Any]) -> float:
        return float(r["closed_at"] + r.get("wall_offset", 0.0) - t0)

    merges: dict[int, list[float]] = {m: [] for m in everyone}
    shares: list[float] = []
    drifts: dict[str, list[float]] = {"honest": [], "attacker": []}
    for r in rounds:
        rd = parse_tape_record(r)
        if isinstance(rd, RoundRecord):
            total = sum(e.weight for e in rd.merged if e.weight > 0)
            if attackers and total > 0:  # the attackers' weight share of each merged round
                shares.append(sum(e.weight for e in rd.merged if e.learner in attackers and e.weight > 0) / total)
            for e in rd.took_part:
                merges.setdefault(e.learner, []).append(t_of(r))
            for e in rd.merged:
                if e.drift > 0:
                    drifts["attacker" if e.learner in attackers else "honest"].append(e.drift)
    refusals: dict[str, dict[str, int]] = {}
    for r in records.records:
        for x in r["rejected"] if r.get("event") == "round" else ([r] if r.get("event") == "rejected" else []):
            who = "attacker" if x["learner"] in attackers else "honest"
            refusals.setdefault(x["reason"], {"attacker": 0, "honest": 0})[who] += 1
    half = duration_s / 2
    honest_times = [t for m in honest for t in merges[m] if 0.1 * duration_s <= t < duration_s]
    attackers = {}
    for name in ("protocol_attacker", "observer_attacker"):
        if (run_dir / f"{name}.json").exists():
            attackers[name] = json.loads((run_dir / f"{name}.json").read_text())
    return {
        "arm": arm,
        "rep": rep,
        "wall_s": wall,
        "eval_loss": eval_loss,
        "honest_merges_per_min": len(honest_times) / (0.9 * duration_s) * 60.0,
        "attacker_merges": sum(len(merges.get(m, [])) for m in attackers),
        "attacker_share_mean": statistics.fmean(shares) if shares else 0.0,
        "drift": {who: quantiles(xs) for who, xs in drifts.items()},
        "drift_values": {who: [round(x, 4) for x in xs] for who, xs in drifts.items()},
        "cut_off": [m for m in honest if not any(t >= half for t in merges[m])],
        "nan_learners": [m for m, xs in losses.items() if any(not math.isfinite(x) for x in xs)],
        "refusals": refusals,
        "syncer_counts": {k: v for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        "invariant_violations": [f"{v.kind}: {v.detail}" for v in check_run(records.records)],
        "attackers": attackers,
        "learner_log_refusals": log_lines(run_dir, ("refus", "ignored"), honest),
    }


def quantiles(xs: list[float]) -> dict[str, float]:
    """The median, 90th percentile and largest of ``xs`` (empty: none)."""
    if not xs:
        return {}
    xs = sorted(xs)
    return {"n": len(xs), "p50": xs[len(xs) // 2], "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1]}


def log_lines(run_dir: Path, words: tuple[str, ...], honest: list[int], most: int = 8) -> dict[str, list[str]]:
    """The honest learners' log lines that say they refused or ignored something."""
    out: dict[str, list[str]] = {}
    for m in honest:
        p = run_dir / f"learner-{m}.log"
        if p.exists():
            hits = [ln for ln in p.read_text(errors="replace").splitlines() if any(w in ln.lower() for w in words)]
            if hits:
                out[str(m)] = hits[:most] + ([f"... {len(hits) - most} more"] if len(hits) > most else [])
    return out


def final_eval_loss(run_dir: Path, rep: int, arm: str) -> float:
    import torch
    from safetensors.torch import load_file

    from ddiloco.training.evaluate import evaluate
    from ddiloco.workloads.config import load_workload

    torch.set_num_threads(1)
    cfg = soak.load_cfg(settings(rep, arm)[len(soak.SETTINGS) :])
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    final = run_dir / "final" / "model.safetensors"
    if not final.exists():
        return float("nan")
    model.load_state_dict(load_file(str(final)))
    return float(evaluate(wl, model, wl.eval_batches()))


# -- the report ----------------------------------------------------------------------------------


def summarise(runs: list[dict[str, Any]], duration_s: float, reps: int) -> dict[str, Any]:
    by_arm = {a: [r for r in runs if r["arm"] == a] for a in ARMS}
    bases = {b: rs for b, rs in by_arm.items() if rs and b.startswith("baseline")}
    base_loss = {b: statistics.fmean(r["eval_loss"] for r in rs) for b, rs in bases.items()}
    base_rate = {b: statistics.fmean(r["honest_merges_per_min"] for r in rs) for b, rs in bases.items()}
    arms = {}
    for a, rs in by_arm.items():
        base = SHAPES[a][3]
        if not rs or base not in base_loss:
            continue
        loss = statistics.fmean(r["eval_loss"] for r in rs)
        rate = statistics.fmean(r["honest_merges_per_min"] for r in rs)
        honest_n, attackers, _, _ = SHAPES[a]
        arms[a] = {
            "fleet": f"{attackers} of {honest_n + attackers}" if attackers else f"{honest_n} honest",
            "baseline": base,
            "runs": len(rs),
            "eval_loss": loss,
            "eval_loss_per_rep": [r["eval_loss"] for r in rs],
            "loss_ratio": loss / base_loss[base],
            "loss_ratio_per_rep": [r["eval_loss"] / base_loss[base] for r in rs],
            "honest_merges_per_min": rate,
            "merge_rate_ratio": rate / base_rate[base],
            "attacker_share_mean": statistics.fmean(r["attacker_share_mean"] for r in rs),
            "attacker_merges": sum(r["attacker_merges"] for r in rs),
            "drift": {who: pooled_drift(rs, who) for who in ("honest", "attacker")},
            "cut_off": sum(len(r["cut_off"]) for r in rs),
            "nan_learners": sum(len(r["nan_learners"]) for r in rs),
            "invariant_violations": sum(len(r["invariant_violations"]) for r in rs),
            "refusals": merge_counts([r["refusals"] for r in rs]),
            "syncer_counts": sum_counts([r["syncer_counts"] for r in rs]),
        }  # fmt: skip
    checks = []
    for a in MUST_HOLD:
        if a in arms:
            checks.append((f"{a}: loss <= {TARGET_LOSS_RATIO}x baseline", arms[a]["loss_ratio"] <= TARGET_LOSS_RATIO,
                           f"{arms[a]['loss_ratio']:.4f}"))  # fmt: skip
    if "protocol" in arms:
        p = arms["protocol"]
        checks.append((f"protocol: honest merge rate >= {TARGET_FLOOD_RATE}x baseline",
                       p["merge_rate_ratio"] >= TARGET_FLOOD_RATE, f"{p['merge_rate_ratio']:.3f}"))  # fmt: skip
        counts = p["syncer_counts"]
        for what, key in (("takeover refused", "impostor"), ("fetch flood limited", "rate_limited")):
            checks.append((f"protocol: {what} ({key} > 0)", counts.get(key, 0) > 0, str(counts.get(key, 0))))
        stale = p["refusals"].get("stale_base", {}).get("attacker", 0)
        checks.append(("protocol: stale answers refused (stale_base)", stale > 0, str(stale)))
    total = lambda key: sum(arms[a][key] for a in arms)  # noqa: E731
    checks += [
        ("0 honest learners cut off", total("cut_off") == 0, str(total("cut_off"))),
        ("0 NaN in any learner", total("nan_learners") == 0, str(total("nan_learners"))),
        ("0 invariant violations", total("invariant_violations") == 0, str(total("invariant_violations"))),
    ]
    honest_refused = {
        a: {k: v["honest"] for k, v in arms[a]["refusals"].items() if v["honest"]} for a in arms if arms[a]["refusals"]
    }
    return {
        "duration_s": duration_s,
        "reps": reps,
        "arms": arms,
        "honest_refusals": {a: v for a, v in honest_refused.items() if v},
        "checks": [{"check": c, "met": ok, "value": v} for c, ok, v in checks],
    }


def pooled_drift(runs: list[dict[str, Any]], who: str) -> dict[str, float]:
    """The quantiles of every drift of ``who`` (honest or attacker) over ``runs``."""
    return quantiles([x for r in runs for x in r.get("drift_values", {}).get(who, [])])


def merge_counts(dicts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for d in dicts:
        for k, v in d.items():
            for who, n in v.items():
                out.setdefault(k, {}).setdefault(who, 0)
                out[k][who] += n
    return out


def sum_counts(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def to_markdown(rep: dict[str, Any]) -> str:
    s = rep["summary"]
    lines = [
        "# Soak, insider phase: keyed attackers among honest learners",
        "",
        f"Command: `{rep['command']}` ({rep['date']}, {rep['machine']['cpus']} CPUs, "
        f"{rep['total_wall_s'] / 60:.0f} min). "
        f"Each run {s['duration_s']:.0f} s of training after start-up, {s['reps']} repetitions per arm (run.seed = "
        "repetition), no kills; the soak's synthetic settings; the robust merge at its defaults with the drift "
        "history on (`algo.robust_drift_limit = 3`, off by default) in every arm but `adaptive_off`. Each arm's "
        "loss is over the attacker-free run of its shape (`baseline`: 3 "
        "honest learners of 4 data shards; `baseline5`: 3 of 5; `baseline8`: 6 of 8). Arms: see "
        "`bench/soak_insider.py`. Drift: the robust merge's drift of each merged answer (its learner's repeated "
        "push over the round's median; `algo.robust_drift_limit` = 3 takes the weight to 0, from 1.5 it falls).",
        "",
        "| arm | attackers | eval loss (mean) | / its baseline (per repetition) | honest merges/min | / baseline | "
        "attackers' mean share | honest drift p90 | attackers' drift p50 | attacker refusals | cut off | NaN | "
        "invariant violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, x in s["arms"].items():
        refused = ", ".join(f"{k} {v['attacker']}" for k, v in sorted(x["refusals"].items()) if v["attacker"]) or "-"
        per_rep = ", ".join(f"{r:.2f}" for r in x.get("loss_ratio_per_rep", []))
        honest_p90 = x.get("drift", {}).get("honest", {}).get("p90")
        attacker_p50 = x.get("drift", {}).get("attacker", {}).get("p50")
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(
            f"| {a} | {x.get('fleet', '')} | {x['eval_loss']:.4f} | {x['loss_ratio']:.3f} ({per_rep}) | "
            f"{x['honest_merges_per_min']:.1f} | {x['merge_rate_ratio']:.2f} | {x['attacker_share_mean']:.3f} | "
            f"{fmt(honest_p90)} | {fmt(attacker_p50)} | {refused} | {x['cut_off']} | {x['nan_learners']} | "
            f"{x['invariant_violations']} |"
        )
    lines += ["", "| check | met | value |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'yes' if c['met'] else '**no**'} | {c['value']} |" for c in s["checks"]]
    p = s["arms"].get("protocol")
    if p:
        lines += ["", "Protocol run, the syncer's counts (summed over repetitions): "
                  + ", ".join(f"{k} {v:g}" for k, v in sorted(p["syncer_counts"].items()))]  # fmt: skip
    if s["honest_refusals"]:
        lines += ["", "Honest contributions refused, by arm and reason: " + json.dumps(s["honest_refusals"])]
    else:
        lines += ["", "No honest contribution was refused in any run."]
    return "\n".join(lines) + "\n"


def run_phase(work: Path, duration_s: float, reps: int, out: Path, command: str, arms: tuple[str, ...] = ARMS) -> int:
    started = time.time()

    def say(r: dict[str, Any]) -> str:
        return (f"eval loss {r['eval_loss']:.4f}, honest merges/min {r['honest_merges_per_min']:.1f}, "
                f"refusals {r['refusals']}")  # fmt: skip

    runs = cached_runs(work, arms, reps, duration_s, run_one, say, "insider")
    rep = facts(command, total_wall_s=time.time() - started, work_dir=str(work), runs=runs)
    rep["summary"] = summarise(runs, duration_s, reps)
    publish(out, "insider", rep, to_markdown(rep), default=str)
    return 0 if all(c["met"] for c in rep["summary"]["checks"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if len(sys.argv) > 2 and sys.argv[1] == "--tampering-learner":
        sys.exit(tampering_learner_main(sys.argv[2], sys.argv[4:]))
    if len(sys.argv) == 6 and sys.argv[1] == "--protocol-attacker":
        sys.exit(protocol_attacker_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
    if len(sys.argv) == 6 and sys.argv[1] == "--observer-attacker":
        sys.exit(observer_attacker_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
    sys.exit("run the insider phase with: python bench/soak.py --insider")
