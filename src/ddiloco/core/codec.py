"""Compressed payloads, both ways (pure: tensors in, tensors out).

Up: a contribution is its delta against the learner's base, the version it last received *as it
holds it*: parameters in the up-link encoding (plain fp32 values when nothing is lossy), plus the
residual its last encoding dropped when error feedback is on; buffers and counts exactly, as
values (statistics are levels, not progress). The learner keeps that one base copy, so the
syncer needs no past versions to anchor contributions on: it keeps only the current one.

Down: a merged version goes as the encoded change from the previous version *as served*, and
the syncer keeps that reconstruction (``Chain``), so a learner on the chain and the syncer hold
the same bits and never drift. A learner off the chain (it missed a version, a delta was lost or
reordered, it rejoined, the syncer restarted) gets the reconstruction in full, exactly.

The learner's side is ``LearnerCodec``; the syncer's is ``Chain`` (one per fragment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ddiloco.core.compress import Encoded, decode, encode
from ddiloco.core.config import DiLoCoConfig
from ddiloco.core.fragments import Piece, storage_bytes
from ddiloco.core.messages import Contribution, FragmentUpdate


def _exact(t: torch.Tensor) -> Encoded:
    return encode(t, "fp32")


def encode_pieces(
    values: Sequence[torch.Tensor], pieces: Sequence[Piece], encoding: str
) -> tuple[list[Encoded], list[torch.Tensor]]:
    """Each piece encoded (parameters in ``encoding``, buffers and counts exactly) and what each
    decodes to."""
    encoded = [encode(v, encoding) if pc.kind == "param" else _exact(v) for v, pc in zip(values, pieces)]
    return encoded, [decode(e) for e in encoded]


class LearnerCodec:
    """A learner's base copies (one per fragment it received) and error-feedback residuals
    (``active``: a lossy encoding either way; otherwise contributions are exact deltas).

    The residual is the learner's own, not the version's: it survives an overwrite by a merged
    version, a rebase and a re-registration (only a new process starts without one).
    """

    def __init__(self, cfg: DiLoCoConfig, fragments: Sequence[Sequence[Piece]]) -> None:
        self.cfg = cfg
        self.pieces = fragments
        self.base: dict[int, tuple[int, list[torch.Tensor]]] = {}
        """Fragment -> (version, its values as this learner holds them)."""
        self.residual: dict[int, list[torch.Tensor]] = {}
        """Fragment -> what its last lossy encoding dropped, per parameter piece (others: empty)."""

    def held_bytes(self) -> dict[str, int]:
        """The bytes this codec holds: ``base`` (one copy of every fragment received) and
        ``residual`` (error feedback's, one per fragment sent with it on)."""

        return {
            "base": sum(storage_bytes(vals) for _, vals in self.base.values()),
            "residual": sum(storage_bytes(r) for r in self.residual.values()),
        }

    @property
    def active(self) -> bool:
        return self.cfg.compressed

    def expand(self, u: FragmentUpdate, onto: FragmentUpdate | None = None) -> FragmentUpdate | str:
        """``u`` as the full version it stands for, or why it cannot be applied (a delta that
        does not chain from the version this learner holds). Full versions pass unchanged.

        ``onto``: a full version of the fragment not yet applied, made by this method (a join's
        earlier catch-up change), to chain from instead of the held base; its values are its
        own, so they are added to in place and reused (a learner catching up by
        dozens of changes then holds one full copy per fragment, not one per change)."""
        if u.kind != "delta":
            return u
        held = self.base.get(u.fragment) if onto is None else (onto.version, onto.values)
        if held is None or held[0] != u.base_version:
            have = "none" if held is None else f"version {held[0]}"
            return f"a delta from version {u.base_version}, holding {have}: waiting for the full version"
        pieces = self.pieces[u.fragment]
        if len(u.values) != len(pieces) or any(d.shape != b.shape for d, b in zip(u.values, held[1])):
            return "a delta that does not fit the fragment's pieces"
        if onto is not None:  # the same sums, in the same order, as applying each change in turn
            full = [b.add_(d) if pc.kind == "param" else d.clone() for b, d, pc in zip(held[1], u.values, pieces)]
        else:
            full = [b + d if pc.kind == "param" else d.clone() for b, d, pc in zip(held[1], u.values, pieces)]
        return dataclasses.replace(u, values=full, kind="values", encoded=[])

    def received(self, u: FragmentUpdate) -> None:
        """A full version was applied: it is the base the next delta (either way) starts from."""
        self.base[u.fragment] = (u.version, [v.float() for v in u.values])

    def encode(self, c: Contribution) -> tuple[Contribution, list[torch.Tensor] | None]:
        """``c`` (values) as this run sends it, and the residual to keep once it is sent (None:
        nothing to keep). Without a base for the fragment (never received, or a contribution
        from another version) it goes as values: the syncer anchors it on its current version
        or answers with that version (a rebase)."""
        held = self.base.get(c.fragment)
        if held is None or held[0] != c.base_version:
            return c, None
        pieces = self.pieces[c.fragment]
        if not self.active:  # exact: the delta itself, computed once here instead of at the syncer
            exact = [b - v.float() if pc.kind == "param" else v.float() for b, v, pc in zip(held[1], c.values, pieces)]
            return dataclasses.replace(c, values=exact, kind="delta"), None
        residual = self.residual.get(c.fragment)
        payload: list[torch.Tensor] = []
        for i, (b, v, pc) in enumerate(zip(held[1], c.values, pieces)):
            if pc.kind != "param":
                payload.append(v.float())
                continue
            delta = b - v.float()
            if residual is not None and self.cfg.error_feedback:
                delta += residual[i]
            payload.append(delta)
        encoded, decoded = encode_pieces(payload, pieces, self.cfg.up_payload)
        kept = None
        if self.cfg.error_feedback:
            kept = [p - d if pc.kind == "param" else torch.empty(0) for p, d, pc in zip(payload, decoded, pieces)]
        return dataclasses.replace(c, values=decoded, kind="delta", encoded=encoded), kept

    def sent(self, fragment: int, residual: list[torch.Tensor] | None) -> None:
        """The contribution whose ``encode`` gave ``residual`` went out: keep what it dropped."""
        if residual is not None:
            self.residual[fragment] = residual


@dataclasses.dataclass
class Chain:
    """The syncer's down-link chain of one fragment: what a learner on it holds (``served``, at
    ``version``), the encoded change that made that version from the one before, and the last
    few such changes (``history``) for a learner that restarts from its own saved state and
    catches up by them (``catch_up``)."""

    version: int
    """The version ``served`` reconstructs."""
    served: list[torch.Tensor]
    """The values a learner on the chain holds at ``version`` (what a full version sends)."""
    start: int
    """The oldest version a delta may chain from: served copies from before this syncer process
    (restored, or initial) are exact only at the version it started with, for learners it served."""
    delta: tuple[list[Encoded], list[torch.Tensor]] | None = None
    """(encoded, decoded) change from ``version - 1`` to ``version``, while the merge that made it
    builds its messages (None otherwise: only a merged version goes as a delta, so keeping it
    would cost a whole copy of the model for nothing)."""
    keep: int = 0
    """How many encoded changes ``history`` keeps (``DiLoCoConfig.chain_history``)."""
    history: dict[int, list[Encoded]] = dataclasses.field(default_factory=dict)
    """Version -> the encoded change that made it from the version before (the newest ``keep``;
    encoded only: a decoded change would cost the fragment in fp32)."""

    def advance(self, version: int, values: Sequence[torch.Tensor], pieces: Sequence[Piece], encoding: str) -> None:
        """The fragment's global values became ``version``: encode the change from what the chain
        serves (so the encoding's error does not accumulate: the next change carries it)."""
        change = [v - s if pc.kind == "param" else v for v, s, pc in zip(values, self.served, pieces)]
        encoded, decoded = encode_pieces(change, pieces, encoding)
        self.served = [s + d if pc.kind == "param" else d for s, d, pc in zip(self.served, decoded, pieces)]
        self.version, self.delta = version, (encoded, decoded)
        if self.keep > 0:
            self.history[version] = encoded
            for old in [v for v in self.history if v <= version - self.keep]:
                del self.history[old]
        elif self.history:
            self.history.clear()

    def can_chain(self, held: int | None) -> bool:
        """Whether a learner holding ``held`` (as the syncer last knew it) takes the delta."""
        return self.delta is not None and held is not None and held == self.version - 1 and held >= self.start

    def catch_up(self, held: int) -> list[tuple[int, list[Encoded]]] | None:
        """The encoded changes that bring a learner holding version ``held`` *as served* to
        ``version``, oldest first (each applies to the version before it); None when the history
        does not reach back that far, or ``held`` was never served by this chain."""
        if not self.start <= held < self.version:
            return None
        changes = [(v, self.history.get(v)) for v in range(held + 1, self.version + 1)]
        if any(enc is None for _, enc in changes):
            return None
        return [(v, enc) for v, enc in changes if enc is not None]

    def history_tensors(self) -> list[torch.Tensor]:
        """The tensors ``history`` holds (for the syncer's memory accounting)."""
        out: list[torch.Tensor] = []
        for encoded in self.history.values():
            for e in encoded:
                out.append(e.data)
                if e.scales is not None:
                    out.append(e.scales)
                if e.indices is not None:
                    out.append(e.indices)
        return out
