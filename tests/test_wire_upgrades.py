"""Peers of another ddiloco version meet today's syncer (issue 36 item 6).

``tests/fixtures/wire-7`` holds what the build of wire schema 7 (before 3462232) sends and what
its decoder requires of every message (``tools/wire_fixtures.py`` wrote it from that build). A
schema-7 peer is served: its messages decode here, and everything the syncer answers it carries
schema 7 and only the fields that build knows. A peer of an unserved schema is refused in one
line naming both versions, in a reply its own build reads; nothing it sends is merged.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from test_security import SETTINGS, register

from ddiloco.config import load_config
from ddiloco.core.messages import Heartbeat
from ddiloco.protocol.messages import GlobalState, JoinReply
from ddiloco.service.base import wire
from ddiloco.service.base.wire import SchemaMismatch, decode, decode_from, encode, refusal
from ddiloco.service.base.wire_schemas import ADDED, OLDEST_SERVED, REFUSAL_FIELDS, SCHEMA, unknown_to
from ddiloco.service.syncer.service import SyncerService

FIXTURES = Path(__file__).parent / "fixtures" / "wire-7"
OLD = json.loads((FIXTURES / "plans.json").read_text())
OLD_MESSAGES = {
    k: [base64.b64decode(f) for f in v] for k, v in json.loads((FIXTURES / "messages.json").read_text()).items()
}


def header(frames) -> dict:
    return json.loads(bytes(frames[0]))


def readable_by_old(frames) -> bool:
    """Whether the schema-7 decoder takes this header: its schema, its type, its fields, all it requires."""
    h = header(frames)
    plan = OLD["messages"].get(h["type"])
    return (
        h["v"] == OLD["schema"]
        and plan is not None
        and set(h["fields"]) <= set(plan["fields"])
        and set(plan["required"]) <= set(h["fields"])
        and {t[0] for t in h["tensors"]} <= set(plan["tensors"])
    )


def test_the_schema_table_says_exactly_what_schema_7_lacks():
    """Today's fields less those ADDED since 7 are schema 7's fields, for every message type: a
    field added without its line in the table (or a message type added) fails here."""
    assert OLD["schema"] == OLDEST_SERVED == 7 and SCHEMA == 8 and set(ADDED) == {8}
    assert set(OLD["messages"]) == set(wire.MESSAGES)
    for name, cls in wire.MESSAGES.items():
        plan, old = wire._plan(cls), OLD["messages"][name]
        assert plan.names - unknown_to(7, name) == set(old["fields"]), name
        assert list(plan.tensors) == old["tensors"], name
        assert plan.required <= set(old["required"]), f"{name}: a field required today that schema 7 may omit"
        assert not unknown_to(7, name) & plan.required, f"{name}: an added field must have a default"


@pytest.mark.parametrize("name", sorted(OLD_MESSAGES))
def test_every_message_a_schema_7_peer_sends_decodes_here(name):
    msg, schema = decode_from(OLD_MESSAGES[name])
    assert type(msg).__name__ == name and schema == 7


def test_answers_to_a_schema_7_peer_are_in_its_schema_and_carry_nothing_it_does_not_know():
    reply = JoinReply(True, "", 77, 0, [0, 1], run="a" * 16)
    frames = encode(reply, 7)
    assert readable_by_old(frames) and "run" not in header(frames)["fields"]
    assert decode_from(frames) == (JoinReply(True, "", 77, 0, [0, 1]), 7)  # what the old build sees
    state = GlobalState(versions={"0": 3}, merged_tokens=9, tensors={}, tokens_per_step=512.0)
    assert readable_by_old(encode(state, 7))
    assert header(encode(state))["v"] == SCHEMA and "tokens_per_step" in header(encode(state))["fields"]


def test_a_schema_7_message_with_a_field_of_schema_8_is_malformed():
    h = header(OLD_MESSAGES["Register"])
    h["fields"]["run"] = "someone-elses-run"
    with pytest.raises(wire.WireError, match="unknown fields 'run'") as e:
        decode([json.dumps(h).encode()])
    assert not isinstance(e.value, SchemaMismatch)


@pytest.mark.parametrize("theirs", [2, 6, 9, 1 << 40])
def test_an_unserved_schema_is_its_own_error_naming_both_versions(theirs):
    h = header(OLD_MESSAGES["Heartbeat"])
    h["v"] = theirs
    with pytest.raises(SchemaMismatch) as e:
        decode([json.dumps(h).encode()])
    assert e.value.theirs == theirs and e.value.kind == "Heartbeat"
    assert f"this build speaks {SCHEMA}, serves {OLDEST_SERVED} to {SCHEMA}" in str(e.value)
    with pytest.raises(ValueError, match="serves none but its own"):
        encode(Heartbeat(0, 1, 1, 0.1, 1), theirs)


@pytest.mark.parametrize("theirs", [2, 5, 6])
def test_a_refusal_reads_in_every_older_schema(theirs):
    h = header(refusal("why", 5, theirs))
    assert h == {"v": theirs, "type": "JoinReply", "fields": dict(zip(REFUSAL_FIELDS, [False, "why", 5, 0, []])),
                 "tensors": []}  # fmt: skip


@pytest.fixture()
def service(tmp_path):
    """A syncer service whose sends are kept, not sent: [(connection, frames)]."""
    cfg = load_config(None, SETTINGS)
    from ddiloco.service.base.transport import InProcessNetwork

    svc = SyncerService(cfg, InProcessNetwork().syncer("inproc://s"), tmp_path, fsync=False)
    svc.sent = []
    svc.sock.send = lambda identity, frames, *rule: svc.sent.append((identity, frames))
    yield cfg, svc
    svc.stop()
    svc.shutdown()


def test_a_schema_7_learner_is_served_in_its_own_schema(service):
    cfg, svc = service
    svc.handle(b"old", encode(register(cfg, 0), 7))  # exactly what the schema-7 build sends (table above)
    to_old = [frames for who, frames in svc.sent if who == b"old"]
    assert to_old and all(readable_by_old(f) for f in to_old)
    first = decode(to_old[0])
    assert isinstance(first, JoinReply) and first.accepted, first
    types = {header(f)["type"] for f in to_old}
    assert "FragmentUpdate" in types  # the join's global state, in schema 7
    svc.handle(b"old", encode(Heartbeat(0, 1, step=3, step_time_s=0.01, tokens=96), 7))
    assert svc.counts["malformed"] == 0 and svc.counts["other_schema"] == 0
    assert 0 in svc.core.learners


OLDER_FIX, NEWER_FIX = "install the syncer's ddiloco version where this one runs", "upgrade the syncer first"


@pytest.mark.parametrize("theirs,fix", [(6, OLDER_FIX), (9, NEWER_FIX)])
def test_a_learner_of_an_unserved_schema_is_refused_in_one_line_and_nothing_it_sends_is_taken(service, theirs, fix):
    cfg, svc = service
    for msg in (register(cfg, 1), Heartbeat(1, 1, step=3, step_time_s=0.01, tokens=96)):
        h = header(encode(msg))
        h["v"] = theirs
        svc.handle(b"other", [json.dumps(h).encode()])
    (who, frames), *rest = svc.sent
    assert who == b"other" and not rest  # one answer: the refusal; the heartbeat is only counted
    h = header(frames)
    assert h["v"] == min(theirs, SCHEMA) and h["type"] == "JoinReply" and not h["fields"]["accepted"]
    reason = h["fields"]["reason"]
    assert f"wire schema {theirs}, the syncer speaks {SCHEMA} and serves {OLDEST_SERVED} to {SCHEMA}" in reason
    assert fix in reason and "\n" not in reason
    assert svc.counts["other_schema"] == 2 and svc.counts["malformed"] == 0 and 1 not in svc.core.learners


def test_a_learner_whose_syncer_speaks_a_schema_it_does_not_serve_stops_with_one_line():
    """The learner's comm thread meets a syncer of a newer schema it cannot read (one that does
    not serve it): the learner stops at its join with one line naming both schemas."""
    import threading

    from test_library import ADDRESS, DictNet, cfg

    import ddiloco
    from ddiloco.errors import RefusedError
    from ddiloco.service.base.transport import InProcessNetwork

    net = InProcessNetwork()
    syncer, done = net.syncer(ADDRESS), threading.Event()
    newer = json.dumps({"v": 10, "type": "JoinReply", "fields": {}, "tensors": []}).encode()

    def answer_in_a_newer_schema() -> None:
        while not done.is_set():
            for got in syncer.recv(0.05, 16):
                syncer.send(got.identity, [newer])

    t = threading.Thread(target=answer_in_a_newer_schema, daemon=True)
    t.start()
    try:
        with pytest.raises(RefusedError) as e:
            ddiloco.Learner(DictNet(), ADDRESS, learner_id=0, config=cfg(), transport=net.learner)
    finally:
        done.set()
        t.join(timeout=10)
    said = str(e.value)
    assert f"speaks wire schema 10, this learner speaks {SCHEMA} and serves {OLDEST_SERVED} to {SCHEMA}" in said
    assert "run the syncer's ddiloco version here" in said and "\n" not in said
