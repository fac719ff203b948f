"""The protocol's own messages around the algorithm's: registration, syncer liveness, the
optimizer hand-off, the run's end and observation.

The algorithm's messages (Join, Leave, Heartbeat, Contribution, Ack, FragmentRequest,
FragmentUpdate) live in ``ddiloco.core.messages``; the sessions (``learner_session``,
``syncer_session``) speak both kinds, and ``service/base/wire.py`` encodes both. A learner registers
with ``Register``, which the syncer session checks against its layout and turns into the core's
``Join``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ddiloco.core.messages import COUNT, ID, MAX_ID, MAX_SERIAL, MERGED_TOKENS, SERIAL, VERSIONS

MAX_PARAMS = 100_000
"""Most parameter tensors a Register may list (the 1 MiB header is usually the tighter bound)."""
MAX_NAME = 1024
"""Longest parameter name in a Register."""
MAX_PARAM_DIMS = 8
MAX_PARAM_DIM = 2**31
MAX_SETTINGS = 64
"""Most run settings a ``Register`` claims or a ``RunSettings`` carries."""
SettingValue = bool | int | float | str
"""A run setting's value (``ddiloco.settings`` says which settings there are)."""
SETTINGS: dict[str, Any] = {"max_len": MAX_SETTINGS, "min": -MAX_SERIAL, "max": MAX_SERIAL}
"""Bounds of a settings dict: its entries, and each number's range (strings: 1024 characters)."""


def check_param_entry(entry: Any) -> str | None:
    """Why ``entry`` (any JSON value) is not a ``[name, shape]`` pair of ``param_spec``, or None.

    The wire checks every element of ``Register.params`` with it alone: it must check everything.
    """
    if not isinstance(entry, (list, tuple)) or len(entry) != 2:
        return "expected [name, shape]"
    name, shape = entry
    if not isinstance(name, str) or len(name) > MAX_NAME:
        return f"name must be a string of at most {MAX_NAME} characters"
    if not name.isascii():
        try:
            name.encode()
        except UnicodeEncodeError:
            return "name is not valid Unicode"
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_PARAM_DIMS:
        return f"shape must be a list of at most {MAX_PARAM_DIMS} dimensions"
    if not all(type(d) is int and 0 <= d <= MAX_PARAM_DIM for d in shape):
        return f"every dimension must be an integer in [0, {MAX_PARAM_DIM}]"
    return None


def first_mismatch(ours: list[list[Any]], theirs: list[list[Any]]) -> str | None:
    """A one-line description of the first tensor where two parameter specs differ, or None."""
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            if a is None:
                return f"learner has an extra tensor {b[0]} {tuple(b[1])}"  # type: ignore[index]
            if b is None:
                return f"learner lacks tensor {a[0]} {tuple(a[1])}"
            return f"tensor #{i}: learner has {b[0]} {tuple(b[1])}, syncer has {a[0]} {tuple(a[1])}"
    return None


RUN_ID_LEN = 64
"""Most characters of a run's identity (``JoinReply.run``)."""


@dataclass(frozen=True)
class Register:
    """Learner -> syncer: register (or re-register after a restart of either side)."""

    learner: int = field(metadata=ID)
    """Learner id."""
    incarnation: int = field(metadata=SERIAL)
    """This process's incarnation (its start time in microseconds)."""
    params: list[list[Any]] = field(metadata={"max_len": MAX_PARAMS, "each": check_param_entry})
    """[name, shape] of every model parameter, in order (checked against the syncer's model)."""
    layout: str = field(metadata={"max_len": 256})
    """Digest of the learner's fragment layout (checked against the syncer's)."""
    base_versions: list[int] = field(default_factory=list, metadata=VERSIONS)
    """Versions of each fragment the learner holds (empty for a fresh process)."""
    pid: int = field(default=0, metadata={"min": 0, "max": 2**31 - 1})
    """Process id (for logs)."""
    device: str = field(default="cpu", metadata={"max_len": 256})
    """Where the learner computes."""
    settings: dict[str, SettingValue] = field(default_factory=dict, metadata=SETTINGS)
    """The run settings the learner was given explicitly ("section.key" -> value, e.g.
    "run.processed_tokens"), checked against the syncer's: the first that differs refuses it.
    Empty: it claims none (it adopted the run's, or it is a simulated learner, which shares
    the syncer's config)."""
    run: str = field(default="", metadata={"max_len": RUN_ID_LEN})
    """The run whose versions ``base_versions`` are (as this shard's ``JoinReply.run`` said to
    the process that saved them); empty: not said. A shard of another run takes the learner as
    holding nothing."""


@dataclass(frozen=True)
class JoinReply:
    """Syncer -> learner: accepted (then FragmentUpdates follow) or refused with a reason."""

    accepted: bool
    """Whether the learner may take part."""
    reason: str = field(metadata={"max_len": 8192})
    """Why not (empty when accepted)."""
    epoch: int = field(metadata=SERIAL)
    """The syncer incarnation (random per start): a new epoch means the syncer restarted."""
    data_position: int = field(metadata=COUNT)
    """Where this learner's data shard resumes (recorded with its last merged contribution)."""
    owned: list[int] = field(metadata={**ID, "max_len": MAX_ID + 1})
    """Fragments this syncer shard owns."""
    retry_after_s: float = field(default=0.0, metadata={"min": 0.0, "max": 3600.0})
    """For a refusal: > 0 means the condition passes (the id's holder may be gone by then):
    register again after this long; 0 means final."""
    superseded: bool = False
    """For a final refusal: a newer process took this learner id over; this one must stop
    (``ddiloco learner`` exits with its own code)."""
    run: str = field(default="", metadata={"max_len": RUN_ID_LEN})
    """This run's identity (made once when its syncer state is first made; empty: unknown): a
    learner that saves its state records it, and claims its versions only in the same run."""


@dataclass(frozen=True)
class SettingsRequest:
    """Learner -> syncer shard 0, before it registers: the run's settings, please. A learner
    given no config adopts them (its fragment layout depends on them, so it asks first)."""

    learner: int = field(metadata=ID)
    """The asking learner's id (checked against the id cap and, with keys, its key)."""
    incarnation: int = field(metadata=SERIAL)
    """The asking process's incarnation."""


@dataclass(frozen=True)
class RunSettings:
    """Syncer -> learner: the run's settings ("section.key" -> value), the answer to a
    ``SettingsRequest`` (a refusal is a ``JoinReply``, a finished run a ``RunEnd``)."""

    settings: dict[str, SettingValue] = field(metadata=SETTINGS)
    """Every setting a learner must agree with (``ddiloco.settings.SETTINGS``)."""


@dataclass(frozen=True)
class SyncerHeartbeat:
    """Syncer -> learner: I am alive (liveness of the syncer, seen from a learner)."""

    epoch: int = field(metadata=SERIAL)
    """Syncer incarnation."""
    shard: int = field(metadata={"min": 0, "max": 1023})
    """Which shard sent it."""
    bound: bool = True
    """False: the shard does not know the sender on this connection (it never registered on
    it, or a newer registration took the id elsewhere): reconnect and register again."""


@dataclass(frozen=True)
class PeerStateRequest:
    """Rejoining learner -> syncer -> a live peer: please send your inner-optimizer state."""

    learner: int = field(metadata=ID)
    """The learner that needs the state."""
    incarnation: int = field(metadata=SERIAL)
    """The asking process's incarnation."""


@dataclass(frozen=True)
class PeerState:
    """Peer -> syncer -> rejoining learner: an inner-optimizer state to warm up from."""

    learner: int = field(metadata=ID)
    """Addressee (the rejoining learner)."""
    source: int = field(metadata={"min": -1, "max": MAX_ID})
    """The peer that sent it (-1: no live peer; the state is empty)."""
    param_groups: list[dict[str, Any]] = field(metadata={"max_len": 1024})
    """The optimizer's param_groups (hyper-parameters and parameter indices)."""
    tensors: dict[str, torch.Tensor]
    """Per-parameter state tensors named 'INDEX.KEY' (e.g. '3.exp_avg')."""


@dataclass(frozen=True)
class FetchGlobal:
    """Observer (evaluator, ``ddiloco export``) -> syncer: send me the global model, or what of
    it changed since the versions I hold."""

    requester: str = field(metadata={"max_len": 256})
    """Who asks (for logs)."""
    held: dict[str, int] = field(default_factory=dict, metadata=VERSIONS)
    """The version of each fragment of this shard the observer already holds (keys are fragment
    indices as strings, as in ``GlobalState.versions``): the answer carries values only for the
    fragments whose version differs. Empty (the default, and every request before wire schema
    8): the values of every fragment. A fragment the shard does not own is ignored (and noted)."""
    versions_only: bool = False
    """True: a poll; the answer lists the versions, the merged tokens and the run's end but
    carries no values at all (a few hundred bytes)."""


@dataclass(frozen=True)
class GlobalState:
    """Syncer -> observer: this shard's fragments of the global model (those the request did not
    already hold)."""

    versions: dict[str, int] = field(metadata=VERSIONS)
    """Version of each owned fragment (keys are fragment indices as strings): always all of them."""
    merged_tokens: float = field(metadata=MERGED_TOKENS)
    """Tokens merged so far."""
    tensors: dict[str, torch.Tensor]
    """Pieces named 'FRAGMENT.PIECE', every piece of each fragment sent (none of the others)."""
    run_ended: bool = False
    """Whether the run has ended (this is the final model): an evaluator stops after it."""
    tokens_per_step: float = field(default=0.0, metadata=MERGED_TOKENS)
    """The tokens one learner processes per inner step, as the fleet's heartbeats report them
    (0: none reported yet): an observer's cadence in merged tokens is sized by it
    (``protocol.config.EvalCadence``)."""


@dataclass(frozen=True)
class RunEnd:
    """Syncer -> learner: the run reached its budget.

    ``stage`` "stop": stop training, but keep applying merged versions and answering fragment
    requests (the final sync merges every live learner's remaining progress); "done": the
    final model is written, leave and exit."""

    stage: Literal["stop", "done"]
    """How far the end has come."""
    reason: str = field(metadata={"max_len": 512})
    """Why the run ended, for the log (e.g. "600,000 global tokens reached (run.processed_tokens)")."""


MAX_STATUS_KEYS = 64
"""Most top-level entries of a StatusReply's ``status``."""


@dataclass(frozen=True)
class StatusRequest:
    """Observer (``ddiloco status``) -> syncer: send me your fleet view (read-only)."""

    requester: str = field(metadata={"max_len": 256})
    """Who asks (for logs)."""


@dataclass(frozen=True)
class StatusReply:
    """Syncer -> observer: this shard's fleet view, the same figures as its status file
    (``service/syncer/fleet_status.py`` builds it; learners and fragments are listed up to a cap)."""

    status: dict[str, Any] = field(metadata={"max_len": MAX_STATUS_KEYS})
    """The status dict (JSON values only; bounded by the wire's header size and nesting)."""
