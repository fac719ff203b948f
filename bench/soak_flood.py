"""The flood phase of the soak (issue 34, item 3): floods that should cost the honest fleet nothing.

    python bench/soak.py --flood                  # 4 arms x 2 repetitions x 45 s (~10 min)

Three honest learners train against a keyed syncer (the soak's synthetic workload, real processes
on loopback); in every arm but the baseline a flooder process starts with the measurement:

- ``idle``: 10,000 slow TCP connections to the syncer without a key (each drips a ZeroMQ
  greeting a byte every 5 s, never finishing it), each reopened as soon as the syncer cuts it
  (``runtime.max_pending_connections``, ``runtime.pending_connection_s``), at most 2,000 a second;
- ``idle_ungated``: the same with the bound off (``runtime.max_pending_connections=0``: only
  ZeroMQ's 30 s handshake timeout), to show what the bound buys;
- ``malformed``: learner 3's key sends malformed frames as fast as the syncer takes them
  (refused before decoding, charged to its key).

Each figure is the honest learners' merges per second over the flood's window (from the tape),
over the baseline's in the same repetition, and the syncer's open descriptors (largest sample,
``/proc/PID/fd``). The flooder is a process of its own on the same 2 cores: what it costs the
machine is in the ratio too, so the ratio is an upper bound on what the syncer's handling costs.
Writes docs/results/flood.md and .json; each run is cached under bench/cache/flood.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import selectors
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import soak_setup as soak  # noqa: E402  (the soak's settings, shared with bench/soak.py)
from harness.cells import cached_runs  # noqa: E402
from harness.cluster import Cluster  # noqa: E402  (bench/harness, beside this script)
from harness.files import TapeReader  # noqa: E402
from harness.paths import sets  # noqa: E402
from harness.tables import facts, publish  # noqa: E402

ARMS = ("baseline", "idle", "idle_ungated", "malformed")
IDLE_CONNECTIONS = 10_000
REOPEN_PER_S = 2_000
"""The idle flooder reopens at most this many cut connections a second (a bound on its own CPU)."""
MALFORMED_PER_S = 2_000
"""Malformed frames a second the key holder sends (as many as its socket takes, up to this)."""
TARGET = 0.9
"""Honest merges per second under a flood over the baseline's: the issue's floor."""
WARMUP_S = 5.0
"""Seconds after the flood starts before the merge rate is counted (the flooder's ramp-up)."""


def arm_settings(arm: str, rep: int) -> list[str]:
    extra = ["runtime.max_pending_connections=0"] if arm == "idle_ungated" else []
    return [*soak.SETTINGS, f"run.seed={rep}", *extra]


GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
"""A valid ZMTP 3.0 greeting (CURVE, as the client): the flooder drips it a byte at a time."""
DRIP_S = 5.0
"""Each idle connection sends the next byte of its greeting every this many seconds (slow, not
silent: a handshake that seems under way)."""


def idle_flooder_main(addr: str, until: float, out: str) -> int:
    """Hold ``IDLE_CONNECTIONS`` slow connections to ``addr`` (each drips a greeting a byte
    every ``DRIP_S``, never finishing it); reopen the cut ones."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, IDLE_CONNECTIONS + 1000), hard))
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    sel = selectors.DefaultSelector()
    opened = cut = refused = peak = dripped = 0
    budget, last = float(IDLE_CONNECTIONS), time.monotonic()
    drip: collections.deque[tuple[float, socket.socket, int]] = collections.deque()  # (due, socket, next byte)

    def open_one() -> None:
        nonlocal opened, refused
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect_ex((host, int(port)))
            sel.register(s, selectors.EVENT_READ)
            drip.append((time.monotonic() + DRIP_S, s, 0))
            opened += 1
        except OSError:
            refused += 1
            s.close()

    while time.time() < until:
        now = time.monotonic()
        budget = min(float(IDLE_CONNECTIONS), budget + REOPEN_PER_S * (now - last))
        last = now
        while len(sel.get_map()) < IDLE_CONNECTIONS and budget >= 1:
            budget -= 1
            open_one()
        peak = max(peak, len(sel.get_map()))
        while drip and drip[0][0] <= now:
            _, s, i = drip.popleft()
            if s.fileno() < 0 or i >= len(GREETING):
                continue  # cut meanwhile, or its greeting is out (it then waits, silent)
            try:
                s.send(GREETING[i : i + 1])
                dripped += 1
            except OSError:
                continue
            drip.append((now + DRIP_S, s, i + 1))
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                if s.recv(4096):
                    continue  # ZeroMQ's greeting: read and ignored
            except BlockingIOError:
                continue
            except OSError:
                pass
            sel.unregister(s)  # closed or reset by the syncer: cut
            s.close()
            cut += 1
    Path(out).write_text(
        json.dumps({"opened": opened, "cut_seen": cut, "refused": refused, "peak_open": peak, "bytes_dripped": dripped})
    )
    return 0


def malformed_flooder_main(addr: str, keys: str, until: float, out: str) -> int:
    """Learner 3's key: frames that decode to nothing, as fast as the socket takes them."""
    import zmq

    from ddiloco.service.base.keys import ClientKeys

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    ClientKeys.load(keys, f"learner-{soak.ATTACKER}").apply(sock)
    sock.connect(addr)
    junk = [b"\x93\xff" + os.urandom(62), os.urandom(1024)]
    sent = dropped = 0
    while time.time() < until:
        start = time.monotonic()
        for _ in range(MALFORMED_PER_S // 20):
            try:
                sock.send_multipart(junk, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                dropped += 1
        time.sleep(max(0.0, 0.05 - (time.monotonic() - start)))
    Path(out).write_text(json.dumps({"sent": sent, "not_taken": dropped}))
    sock.close(0)
    return 0


def descriptors(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def run_one(work: Path, arm: str, rep: int, duration_s: float) -> dict[str, Any]:
    from ddiloco.core.tape import RoundRecord, parse_tape_record
    from ddiloco.service.base.keys import make_keys

    run_dir = work / f"{arm}-{rep}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    keys = work / "keys"
    make_keys(keys, learners=4)
    c = Cluster(run_dir, sets(arm_settings(arm, rep)), keys=keys)
    c.syncer()
    deadline = time.time() + 300
    while not c.status("syncer-0") and time.time() < deadline:
        time.sleep(0.1)
    for m in soak.HONEST:
        c.learner(m, threads=1)
    deadline = time.time() + 300
    while not all(c.status(f"learner-{m}").get("steps", 0) > 0 for m in soak.HONEST) and time.time() < deadline:
        time.sleep(0.2)
    t0 = time.time()
    end = t0 + duration_s
    flooder = run_dir / "flooder.json"
    if arm in ("idle", "idle_ungated"):
        c.start("flooder", [sys.executable, __file__, "--idle-flooder", c.addr, f"{end:.3f}", str(flooder)])
    elif arm == "malformed":
        argv = [sys.executable, __file__, "--malformed-flooder", c.addr, str(keys), f"{end:.3f}", str(flooder)]
        c.start("flooder", argv)
    fds: list[int] = []
    while time.time() < end:
        n = descriptors(c.pid("syncer"))
        if n is not None:
            fds.append(n)
        time.sleep(0.5)
    if "flooder" in c.procs:
        c.procs["flooder"].wait(timeout=60)
    st = c.status("syncer-0")
    c.stop()
    records = TapeReader(run_dir / "state" / "tape.jsonl")
    records.poll()
    times = []
    for r in records.records:
        if r.get("event") != "round":
            continue
        rd = parse_tape_record(r)
        if isinstance(rd, RoundRecord):
            t = float(r["closed_at"] + r.get("wall_offset", 0.0) - t0)
            times += [t for e in rd.took_part if e.learner in soak.HONEST and WARMUP_S <= t < duration_s]
    counts = {k: st.get(k) for k in ("connections_cut", "connections_pending", "malformed", "rate_limited")}
    return {
        "arm": arm,
        "rep": rep,
        "duration_s": duration_s,
        "honest_merges_per_s": len(times) / (duration_s - WARMUP_S),
        "syncer_fds_max": max(fds) if fds else None,
        "syncer_fds_median": statistics.median(fds) if fds else None,
        "syncer_counts": counts,
        "syncer_cpu_s": st.get("cpu_s"),
        "flooder": json.loads(flooder.read_text()) if flooder.exists() else None,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    base = {r["rep"]: r["honest_merges_per_s"] for r in runs if r["arm"] == "baseline"}
    arms = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        ratios = [r["honest_merges_per_s"] / base[r["rep"]] for r in rs if base.get(r["rep"])]
        arms[arm] = {
            "honest_merges_per_s": statistics.fmean(r["honest_merges_per_s"] for r in rs) if rs else None,
            "ratio": statistics.fmean(ratios) if ratios else None,
            "ratios": ratios,
            "syncer_fds_max": max((r["syncer_fds_max"] or 0) for r in rs) if rs else None,
        }
    checks = [
        {"arm": a, "what": f"honest merges/s >= {TARGET}x the baseline", "value": arms[a]["ratio"],
         "met": arms[a]["ratio"] is not None and arms[a]["ratio"] >= TARGET}
        for a in ("idle", "malformed")
    ]  # fmt: skip
    return {"arms": arms, "checks": checks}


def to_markdown(rep: dict[str, Any]) -> str:
    s = rep["summary"]
    lines = [
        "# Floods against the syncer (issue 34, item 3)",
        "",
        f"Command: `{rep['command']}` ({rep.get('date', '')}). Three honest learners, keys on, the soak's synthetic "
        f"workload; the flood runs over each run's measurement, the merge rate counted from {WARMUP_S:g} s in. The "
        "flooder is a process on the same 2 cores: its own CPU is in the ratio.",
        "",
        "| arm | honest merges/s | over the baseline (per repetition) | syncer descriptors (max) |",
        "|---|---|---|---|",
    ]
    for arm, a in s["arms"].items():
        ratio = "" if a["ratio"] is None else f"{a['ratio']:.3f} ({', '.join(f'{x:.3f}' for x in a['ratios'])})"
        rate = "" if a["honest_merges_per_s"] is None else f"{a['honest_merges_per_s']:.2f}"
        lines.append(f"| {arm} | {rate} | {ratio} | {a['syncer_fds_max']} |")
    lines += ["", "Checks:", ""]
    for ch in s["checks"]:
        v = "n/a" if ch["value"] is None else f"{ch['value']:.3f}"
        lines.append(f"- {ch['arm']}: {ch['what']}: {v} ({'met' if ch['met'] else 'NOT met'})")
    lines += ["", "Per run (syncer counts and the flooder's own):", ""]
    for r in rep["runs"]:
        lines.append(f"- {r['arm']} rep {r['rep']}: {r['honest_merges_per_s']:.2f} merges/s, fds max "
                     f"{r['syncer_fds_max']}, syncer {r['syncer_counts']}, flooder {r['flooder']}")  # fmt: skip
    return "\n".join(lines) + "\n"


def run_phase(work: Path, duration_s: float, reps: int, out: Path, command: str) -> int:
    started = time.time()

    def say(r: dict[str, Any]) -> str:
        fds = r["syncer_fds_max"]
        return f"honest merges/s {r['honest_merges_per_s']:.2f}, syncer fds max {fds}, {r['syncer_counts']}"

    runs = cached_runs(work, ARMS, reps, duration_s, run_one, say, "flood")
    rep = facts(command, total_wall_s=time.time() - started, work_dir=str(work), runs=runs)
    rep["summary"] = summarise(runs)
    publish(out, "flood", rep, to_markdown(rep), default=str)
    return 0 if all(c["met"] for c in rep["summary"]["checks"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if len(sys.argv) == 5 and sys.argv[1] == "--idle-flooder":
        sys.exit(idle_flooder_main(sys.argv[2], float(sys.argv[3]), sys.argv[4]))
    if len(sys.argv) == 6 and sys.argv[1] == "--malformed-flooder":
        sys.exit(malformed_flooder_main(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
    sys.exit("run the flood phase with: python bench/soak.py --flood")
