"""The protocol sessions: pure state machines around the algorithm's core.

A ``LearnerSession`` and a ``SyncerSession`` hold every rule of the protocol that is not the
algorithm itself (registration, shard links, heartbeats and liveness, backoff as deadlines, the
step boundary, the optimizer hand-off relay, the budget and the run's end). Like the core they
never read a clock, open a socket, sleep, log or touch a file: they are handed messages, ticks
and the time, and return what the driver must do. The simulator pumps them in virtual time, the
service with sockets, threads and a store. This package imports only ``ddiloco.core``.
"""
