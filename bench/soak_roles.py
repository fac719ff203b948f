"""The soak's hostile processes (bench/soak.py starts them; each ends at its deadline and writes
what it sent into the run folder):

- the attacker: learner 3 with its valid key, answering with corrupted contributions in rotation
  (NaN, 100x the honest norm, inflated counters, replays, wrong shapes, hostile buffers);
- the intruder: no key, then a random unknown key: garbage, Registers, and a connection flood.

    python bench/soak_roles.py --attacker --addr ADDR --keys KEYS --run-dir RUN --until T --attack-from T
    python bench/soak_roles.py --intruder --addr ADDR --keys KEYS --run-dir RUN --until T --flood-from T
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.files import TapeReader  # noqa: E402
from soak_setup import ATTACKER, ATTACKS, BUFFER_ATTACKS, HONEST, STRANGER_ID, load_cfg  # noqa: E402

# -- the attacker (learner id 3 with its valid key) ----------------------------------------------


def attacker_main(args) -> int:
    import torch
    import zmq

    torch.set_num_threads(1)
    from ddiloco.core.messages import Contribution, FragmentRequest, FragmentUpdate, Heartbeat
    from ddiloco.core.tape import RoundRecord, parse_tape_record
    from ddiloco.protocol.messages import JoinReply, Register, SyncerHeartbeat
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.transport import learner_identity
    from ddiloco.service.base.wire import WireError, decode, encode
    from ddiloco.training.layout import layout_for, param_spec
    from ddiloco.workloads.config import load_workload

    cfg = load_cfg()
    wl = load_workload(cfg.workload)
    model = wl.build_model(cfg.run.seed)
    layout = layout_for(model, wl, cfg.algo)
    spec = param_spec(model)
    H = cfg.algo.sync_every
    gen = torch.Generator().manual_seed(1)
    run_dir = Path(args.run_dir)
    log = open(run_dir / "attacks.jsonl", "a")
    tape = TapeReader(run_dir / "state" / "tape.jsonl")
    honest_norms: dict[int, list[float]] = {}
    inc = time.time_ns() // 1000
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, learner_identity(ATTACKER))
    ClientKeys.load(args.keys, f"learner-{ATTACKER}").apply(sock)
    sock.connect(args.addr)
    versions: dict[int, int] = {}
    values: dict[int, list[torch.Tensor]] = {}
    seq, epoch, registered_at, heard = 0, None, 0.0, 0.0
    last_filler: dict[int, list] = {}
    # Per fragment: whether its next answer attacks (every second one), and where it is in its
    # own list of attacks. Shared counters let the interleaving of requests decide which kinds
    # a fragment gets: a loaded machine once sent one hostile-buffer kind never.
    turn: dict[int, int] = {}
    rotation: dict[int, int] = {}
    t_start = time.monotonic()

    def record(kind: str, **kw) -> None:
        log.write(json.dumps({"t": time.time(), "kind": kind, "incarnation": inc, **kw}) + "\n")
        log.flush()

    def register() -> None:
        nonlocal registered_at
        registered_at = time.monotonic()
        sock.send_multipart(encode(Register(ATTACKER, inc, spec, layout.digest, [], os.getpid())))

    def norm_of_honest(p: int) -> float:
        for r in tape.poll():
            rd = parse_tape_record(r)
            if isinstance(rd, RoundRecord):
                for e in rd.took_part:
                    if e.learner in HONEST:
                        honest_norms.setdefault(rd.fragment, []).append(e.norm)
        xs = honest_norms.get(p, [])[-4:]
        return max(xs) if xs else 0.0  # the current honest level (0: no reference for p yet)

    def answer(req: FragmentRequest) -> None:
        nonlocal seq
        p = req.fragment
        if p not in values:
            return
        base = values[p]
        steps = H
        step = int((time.monotonic() - t_start) / 0.05)
        attacking = time.time() >= args.attack_from
        # A fragment that holds buffers gets the hostile-buffer attacks that fit it; the others
        # the rest: every kind comes round within a short run, whatever the machine's speed.
        names = [pc.name for pc in layout.fragments.fragments[p]]
        fitting = [k for k, suffix in BUFFER_ATTACKS.items() if any(n.endswith(suffix) for n in names)]
        general = [k for k in ATTACKS if k not in BUFFER_ATTACKS]
        kinds = fitting or general
        kind = "filler"
        if attacking and turn.get(p, 0) % 2 == 1:
            kind = kinds[rotation.get(p, 0) % len(kinds)]
            rotation[p] = rotation.get(p, 0) + 1
        turn[p] = turn.get(p, 0) + 1
        if kind == "replay" and p not in last_filler:
            kind = "filler"
        if kind == "norm_100x" and norm_of_honest(p) == 0.0:
            kind = "filler"  # "100x the honest norm" needs an honest norm of this fragment to scale
        target = next((i for i, n in enumerate(names) if n.endswith(BUFFER_ATTACKS.get(kind, "\0"))), None)
        if kind == "replay":
            frames, ident = last_filler[p]
            sock.send_multipart(frames)
            record("replay", fragment=p, seq=ident[1], base_version=ident[0])
            return
        seq += 1
        vals = [v.clone() for v in base]
        tokens = 0
        if kind == "filler":  # zero steps, zero tokens: accepted with weight 0 (sets up replays)
            steps = 0
        elif kind == "nan":
            vals[0].view(-1)[0] = float("nan")
            tokens = steps * cfg.workload.batch_size
        elif kind == "norm_100x":
            d = [torch.randn(v.shape, generator=gen) for v in vals]
            scale = 100 * norm_of_honest(p) / math.sqrt(sum(float(x.norm()) ** 2 for x in d))
            vals = [v + scale * x for v, x in zip(vals, d)]
            tokens = steps * cfg.workload.batch_size
        elif kind == "inflated_counters":
            tokens = 10**7 * steps + steps  # tokens/steps just above max_tokens_per_step = 1e7
        elif kind == "wrong_shape":
            vals[0] = torch.zeros(*[s + 1 for s in vals[0].shape])
            tokens = steps * cfg.workload.batch_size
        elif target is not None:  # the hostile buffers, with honest counters
            tokens = steps * cfg.workload.batch_size
            if kind == "buffer_nan":
                vals[target].view(-1)[0] = float("nan")
            elif kind == "buffer_negative_var":
                vals[target].fill_(-1.0)
            elif kind == "buffer_count":
                vals[target].fill_(float(2**23))
            else:  # buffer_shape
                vals[target] = torch.zeros(vals[target].numel() + 1)
        msg = Contribution(ATTACKER, inc, p, versions[p], seq, vals, steps, tokens, 0, step)
        frames = encode(msg)
        sock.send_multipart(frames)
        if kind == "filler":
            last_filler[p] = (frames, (versions[p], seq))
        record(kind, fragment=p, seq=seq, base_version=versions[p])

    register()
    last_hb = 0.0
    while time.time() < args.until:
        now = time.monotonic()
        if sock.poll(50):
            try:
                msg = decode(sock.recv_multipart())
            except WireError:
                continue
            heard = now
            if isinstance(msg, JoinReply):
                if msg.accepted:
                    epoch = msg.epoch
                    record("registered", epoch=epoch)
                else:
                    record("refused", reason=msg.reason[:200])
            elif isinstance(msg, SyncerHeartbeat):
                if msg.epoch != epoch and now - registered_at > 1.0:
                    epoch = None
                    register()
            elif isinstance(msg, FragmentUpdate):
                versions[msg.fragment] = msg.version
                values[msg.fragment] = [v.clone() for v in msg.values]
            elif isinstance(msg, FragmentRequest):
                answer(msg)
        if now - last_hb >= 0.25:
            last_hb = now
            step = int((now - t_start) / 0.05)
            sock.send_multipart(encode(Heartbeat(ATTACKER, inc, step, 0.05)))
        if now - heard > 3.0 and now - registered_at > 3.0:
            register()  # the syncer is gone or restarted: keep trying
    log.close()
    sock.close(0)
    return 0


# -- the intruder (no key, then an unknown key) ----------------------------------------------------


def intruder_main(args) -> int:
    import zmq
    import zmq.auth

    from ddiloco.protocol.messages import Register
    from ddiloco.service.base.keys import ClientKeys
    from ddiloco.service.base.transport import learner_identity
    from ddiloco.service.base.wire import encode

    ctx = zmq.Context.instance()
    server = ClientKeys.load(args.keys, "observer").server  # the syncer's public key is public
    reg = Register(STRANGER_ID, 1, [["w", [1]]], "x" * 16, [], os.getpid())
    rep = {
        "connections": 0,
        "messages": 0,
        "not_queued": 0,
        "replies": 0,
        "garbage": 0,
        "registers": 0,
        "flood_connections": 0,
        "flood_s": 0.0,
    }
    rng = random.Random(2)
    socks: list = []

    def new_socket(keyed: bool, identity: bytes | None = None):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        if keyed:
            pub, sec = zmq.curve_keypair()
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = sec, pub, server
        s.connect(args.addr)
        rep["connections"] += 1
        return s

    def send_junk(s, i: int) -> None:
        # A DEALER whose handshake never completes has no peer: a blocking send would wait forever.
        if i % 2:
            frames = [rng.randbytes(rng.randint(1, 512)) for _ in range(rng.randint(1, 3))]
            rep["garbage"] += 1
        else:
            m = Register(rng.choice([0, 1, 2, 3, STRANGER_ID]), 1, reg.params, reg.layout, [], os.getpid())
            frames = encode(m)
            rep["registers"] += 1
        rep["messages"] += 1
        try:
            s.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            rep["not_queued"] += 1

    # two long-lived clients: no key, and a random unknown key, claiming learner identities
    socks = [new_socket(False, learner_identity(0)), new_socket(True, learner_identity(STRANGER_ID))]
    i = 0
    next_flood = time.time()
    flood_started = None
    while time.time() < args.until:
        for s in socks:
            send_junk(s, i)
            i += 1
            while s.poll(0):
                s.recv_multipart()
                rep["replies"] += 1
        if time.time() >= args.flood_from:  # ~100 fresh connections per second, bounded
            flood_started = flood_started or time.time()
            batch = []
            while next_flood <= time.time() and len(batch) < 20:
                next_flood = max(next_flood + 0.01, time.time() - 0.1)
                s = new_socket(rng.random() < 0.5)
                send_junk(s, i)
                i += 1
                batch.append(s)
                rep["flood_connections"] += 1
            time.sleep(0.02)
            for s in batch:
                while s.poll(0):
                    s.recv_multipart()
                    rep["replies"] += 1
                s.close(0)
        time.sleep(0.05)
    for s in socks:
        s.close(0)
    rep["flood_s"] = time.time() - flood_started if flood_started else 0.0
    (Path(args.run_dir) / "intruder.json").write_text(json.dumps(rep))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    role = ap.add_mutually_exclusive_group(required=True)
    role.add_argument("--attacker", action="store_true")
    role.add_argument("--intruder", action="store_true")
    ap.add_argument("--addr", required=True)
    ap.add_argument("--keys", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--until", type=float, required=True)
    ap.add_argument("--attack-from", type=float, default=0.0)
    ap.add_argument("--flood-from", type=float, default=0.0)
    args = ap.parse_args()
    return attacker_main(args) if args.attacker else intruder_main(args)


if __name__ == "__main__":
    sys.exit(main())
