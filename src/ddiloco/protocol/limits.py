"""Token buckets: how often a peer may do something before it stops being listened to.

Pure (the time is handed in), so the sessions use them for their rules and the service for its
receipt-time limits alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class RateLimits(Generic[K]):
    """One token bucket per key (``rate`` per second, bursts of ``burst``), for at most
    ``max_keys`` keys: the least recently used is forgotten first, so a flood of new keys
    cannot grow memory."""

    def __init__(self, rate: float, burst: float, max_keys: int = 4096) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[K, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self.dropped = 0

    def _level(self, key: K, now: float) -> float:
        tokens, at = self._buckets.pop(key, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - at) * self.rate)

    def _keep(self, key: K, tokens: float, now: float) -> None:
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    def allow(self, key: K, now: float, cost: float = 1.0) -> bool:
        """Whether one more event of ``key`` at ``now`` is within its rate (it is charged
        ``cost`` tokens if so)."""
        tokens = self._level(key, now)
        ok = tokens >= cost
        self._keep(key, tokens - cost if ok else tokens, now)
        if not ok:
            self.dropped += 1
        return ok

    def has(self, key: K, now: float) -> bool:
        """Whether ``key`` has any tokens left (a cost known only afterwards is then ``charge``d)."""
        tokens = self._level(key, now)
        self._keep(key, tokens, now)
        ok = tokens > 0.0
        if not ok:
            self.dropped += 1
        return ok

    def charge(self, key: K, now: float, cost: float) -> None:
        """Take ``cost`` tokens from ``key`` (its level may go below zero: it waits longer)."""
        self._keep(key, self._level(key, now) - cost, now)
