"""Token buckets: how often a peer may do something before the syncer stops listening to it."""

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

    def allow(self, key: K, now: float) -> bool:
        """Whether one more event of ``key`` at ``now`` is within its rate (it is counted if so)."""
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        if not ok:
            self.dropped += 1
        return ok
