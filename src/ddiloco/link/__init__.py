"""A user-space link emulator: a TCP relay between a learner and its syncer that shapes the
byte stream (rate, latency, jitter, stalls), shares a site's aggregate cap, and injects resets
and partitions. ``config``: the link and fault strings (pure); ``shaper``: the scheduler (pure,
virtual time, seeded); ``relay``: the asyncio relay; ``command``: ``ddiloco link`` and the plan
the launcher hands it. Nothing is imported here, so that parsing a chaos section stays cheap."""
