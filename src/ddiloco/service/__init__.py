"""Driver 2: the real distributed runtime, in four wings, each importing only the wings below it.

- ``base``: what every process stands on (wire format, transport, keys, clocks, status files,
  start-up phases, observer requests); imports no other wing.
- ``syncer``: the syncer process (the service that pumps ``SyncerSession``, its durable store,
  fleet status, flight recorder, load accounting, ``SyncerServer`` and its evaluate hook);
  imports ``base``.
- ``learner``: the learner process (``ddiloco.Learner``, its comm thread, device copies, the
  ``ddiloco learner`` process); imports ``base``. The syncer and learner wings never import each
  other.
- ``ops``: operations on a run (the local launcher, the evaluator process, ``ddiloco status``,
  learners' books); may import every wing.
"""
