"""The syncer process: the service that pumps a ``SyncerSession`` with the network, its durable
store, fleet status, flight recorder, load accounting, ``SyncerServer`` and its evaluate hook.
Imports ``service.base`` only, never ``service.learner``."""
