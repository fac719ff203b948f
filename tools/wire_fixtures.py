"""Keep a ddiloco build's wire as fixtures: the messages an older learner or observer sends, and
what its decoder requires of every message type.

Run it with the *older* build on the path, e.g. for wire schema 7 (the build before 3462232):

    git worktree add /tmp/wire7 3462232^
    PYTHONPATH=/tmp/wire7/src python tools/wire_fixtures.py tests/fixtures/wire-7

It writes ``messages.json`` (each message's frames, base64) and ``plans.json`` (the schema, and
per message type its field names, required fields and tensor fields, from that build's decoder).
``tests/test_wire_upgrades.py`` decodes the messages with today's build and checks that what
today's syncer answers in that schema is what the older decoder accepts.
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import torch

from ddiloco.service.base import wire  # the build on the path: the older one
from ddiloco.service.base.wire import decode, encode


def sample_messages() -> dict[str, object]:
    """One message of each kind a learner or an observer sends, as the build on the path makes them."""
    m = wire.MESSAGES
    values = [torch.arange(6, dtype=torch.float32).reshape(2, 3) / 10, torch.ones(3)]
    return {
        "SettingsRequest": m["SettingsRequest"](learner=1, incarnation=1_700_000_000_000_001),
        "Register": m["Register"](
            learner=1,
            incarnation=1_700_000_000_000_001,
            params=[["w", [2, 3]], ["b", [3]]],
            layout="a1b2c3",
            base_versions=[3],
            pid=4242,
            device="cpu",
        ),
        "Heartbeat": m["Heartbeat"](
            learner=1, incarnation=1_700_000_000_000_001, step=12, step_time_s=0.25, tokens=12288, busy_s=3.0
        ),
        "Contribution": m["Contribution"](
            learner=1,
            incarnation=1_700_000_000_000_001,
            fragment=0,
            base_version=3,
            seq=5,
            values=values,
            steps=4,
            tokens=4096,
            data_position=4096,
            step=12,
        ),
        "Leave": m["Leave"](learner=1, incarnation=1_700_000_000_000_001),
        "FetchGlobal": m["FetchGlobal"](requester="evaluator"),
        "StatusRequest": m["StatusRequest"](requester="status"),
    }


def plans() -> dict[str, object]:
    """What this build's decoder requires of each message type."""
    out: dict[str, object] = {}
    for name, cls in sorted(wire.MESSAGES.items()):
        plan = wire._plan(cls)
        out[name] = {"fields": sorted(plan.names), "required": sorted(plan.required), "tensors": list(plan.tensors)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the fixture folder to write")
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    messages = {}
    for name, msg in sample_messages().items():
        frames = [bytes(memoryview(f).cast("B")) for f in encode(msg)]
        decode(frames)  # the build reads its own frames back
        messages[name] = [base64.b64encode(f).decode() for f in frames]
    (out / "messages.json").write_text(json.dumps(messages, indent=1) + "\n")
    (out / "plans.json").write_text(json.dumps({"schema": wire.SCHEMA, "messages": plans()}, indent=1) + "\n")
    print(f"wire schema {wire.SCHEMA}: {len(messages)} messages and {len(wire.MESSAGES)} plans written to {out}")


if __name__ == "__main__":
    main()
