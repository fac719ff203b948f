"""The fragment updates a learner received since its last step boundary (pure).

Updates are applied in order at the boundary (``LearnerSession.boundary``). One kind is folded
as it arrives: a join's chained catch-up changes (a learner restored from its saved state gets
the down-link chain's encoded changes since the versions it held, oldest first). Each is
expanded onto the one before it while that still waits here, so a learner catching up by
dozens of changes holds one full copy per fragment until its boundary, instead of every decoded
change and then every full version (about 3 N more at 100M). The sums are the same, in the same
order, as applying each change in turn: the learner still holds the bits the syncer serves.
"""

from __future__ import annotations

from collections.abc import Iterator

from ddiloco.core.codec import LearnerCodec
from ddiloco.core.messages import FragmentUpdate


class Inbox:
    """Updates waiting for the next boundary, in arrival order, catch-up changes folded."""

    def __init__(self, codec: LearnerCodec) -> None:
        self.codec = codec
        self._updates: list[FragmentUpdate] = []
        self._folded: dict[int, int] = {}  # fragment -> index of its expanded catch-up, the last update for it

    def keep(self, msg: FragmentUpdate) -> None:
        """Keep ``msg`` for the boundary; a chained catch-up change is expanded now when it can
        be (onto the fragment's folded catch-up, or onto the held base when nothing else for
        the fragment waits). What cannot be expanded waits as it came: the boundary says why."""
        p, onto = msg.fragment, self._folded.pop(msg.fragment, None)
        in_layout = 0 <= p < len(self.codec.pieces)
        alone = onto is None and not any(u.fragment == p for u in self._updates)
        if msg.reason == "join" and msg.kind == "delta" and in_layout and (onto is not None or alone):
            u = self.codec.expand(msg, None if onto is None else self._updates[onto])
            if not isinstance(u, str):
                if onto is None:
                    self._folded[p] = len(self._updates)
                    self._updates.append(u)
                else:
                    self._updates[onto] = u
                    self._folded[p] = onto
                return
        self._updates.append(msg)

    def __iter__(self) -> Iterator[FragmentUpdate]:
        return iter(self._updates)

    def __len__(self) -> int:
        return len(self._updates)

    def clear(self) -> None:
        self._updates.clear()
        self._folded.clear()
