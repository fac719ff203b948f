"""Token buckets (``ddiloco.protocol.limits``): the service's receipt-time limits use the same
class as the sessions' rules."""

from __future__ import annotations

from ddiloco.protocol.limits import RateLimits

__all__ = ["RateLimits"]
