"""What a learner knows of one syncer shard: ``ShardLink``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ShardLink:
    """What the learner knows of one syncer shard."""

    backoff: float
    """The next re-registration delay (doubles up to ``backoff_max_s``)."""
    epoch: int | None = None
    """The shard's incarnation, as its last accepted registration said."""
    last_heard: float | None = None
    """When anything was last heard from it."""
    joined: bool = False
    """Whether it accepted this learner's registration (and has not gone silent or restarted since)."""
    warned: bool = False
    """Whether its silence was said (once, until it is heard again)."""
    next_join: float = -math.inf
    """When to register (again) while not joined."""
    owned: list[int] = field(default_factory=list)
    """The fragments it owns."""
    lost_at: float | None = None
    """When it stopped counting this learner as joined (gone silent, restarted, lost our
    connection): the next acceptance is a rejoin."""
    run: str = ""
    """The run's identity, as its acceptance said (``JoinReply.run``)."""
