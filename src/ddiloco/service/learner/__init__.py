"""The learner process: ``ddiloco.Learner`` (any training loop as a learner), its comm thread,
device copies and model check, and the ``ddiloco learner`` process. Imports ``service.base``
only, never ``service.syncer``."""
