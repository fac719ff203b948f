"""Which wire schemas this build speaks, and what each older one lacks.

A peer of an older schema is *served* when every difference since its schema is a field with a
default that the older peer can do without: its messages decode here (the fields it does not
know take their defaults), and what this build sends it leaves those fields out and carries its
schema number, so the older build decodes it as its own. A peer outside ``OLDEST_SERVED ..
SCHEMA`` is refused: a joining learner gets a ``JoinReply`` refusal in its own schema (its five
``REFUSAL_FIELDS`` decode in every schema since 2) naming both versions; every message of such a
peer is counted (``other_schema``) and taken nowhere, and an observer's request (an evaluator, an
older ``ddiloco status``) is not answered: only the syncer's log says why.

Adding a field with a default: bump ``SCHEMA`` and list the field under the new number in
``ADDED`` (with what an older peer misses). A change an older peer cannot do without (a new
required field, a field whose meaning changed, a new message an older syncer must answer)
raises ``OLDEST_SERVED`` to the new schema.
"""

from __future__ import annotations

import functools

SCHEMA = 8
"""The schema this build writes (2: incarnations and seqs, Register; 3: RunEnd, heartbeat progress,
status query; 4: merged_tokens; 5: run settings (Register.settings, SettingsRequest, RunSettings),
JoinReply.superseded; 6: encoded payloads (Contribution.encoded, FragmentUpdate.kind/base_version/
encoded); 7: Contribution.routed (routed-token counts); 8: FetchGlobal.held/versions_only (an
observer fetches what changed), GlobalState.tokens_per_step, Register.run and JoinReply.run (a
learner restarted from its saved state claims versions of its run only))."""

OLDEST_SERVED = 7
"""The oldest schema whose peers are served (schema 7 is ddiloco's wire before 2026-12-03, commit
3462232; its frames are kept in ``tests/fixtures/wire-7``)."""

ADDED: dict[int, dict[str, frozenset[str]]] = {
    # What a schema-7 peer misses: a learner does not learn its run's identity (it saves its
    # state without one, and a restart of it claims its versions as before: the syncer checks
    # them against its own store either way); an observer fetches every fragment instead of what
    # changed, and sizes its cadence by its own estimate of the tokens per step.
    8: {
        "Register": frozenset({"run"}),
        "JoinReply": frozenset({"run"}),
        "FetchGlobal": frozenset({"held", "versions_only"}),
        "GlobalState": frozenset({"tokens_per_step"}),
    },
}
"""Fields each schema added to a message (all with defaults), by schema then message name."""

REFUSAL_FIELDS = ("accepted", "reason", "epoch", "data_position", "owned")
"""The ``JoinReply`` fields every schema since 2 has, and requires: a refusal made of them alone
reads in any of them."""


def served(schema: int) -> bool:
    """Whether a peer speaking ``schema`` is served."""
    return OLDEST_SERVED <= schema <= SCHEMA


@functools.cache
def unknown_to(schema: int, message: str) -> frozenset[str]:
    """The fields of ``message`` that a peer of (served) ``schema`` does not know."""
    out: set[str] = set()
    for s in range(schema + 1, SCHEMA + 1):
        out |= ADDED.get(s, {}).get(message, frozenset())
    return frozenset(out)


def refusal_reason(theirs: int, role: str = "learner") -> str:
    """One line for a peer of an unserved schema: both versions, and what to do."""
    if theirs > SCHEMA:
        fix = "upgrade the syncer first (a syncer serves learners of its own and older schemas)"
    else:
        fix = "install the syncer's ddiloco version where this one runs, and start it again"
    return (
        f"this {role} speaks wire schema {theirs}, the syncer speaks {SCHEMA} and serves {OLDEST_SERVED} to {SCHEMA}: "
        f"{fix}"
    )
