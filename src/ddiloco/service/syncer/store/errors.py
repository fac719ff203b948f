"""The syncer store's errors: each says in one line what is wrong with the state folder and what to do."""

from __future__ import annotations

from ddiloco.errors import DDiLoCoError


class StateError(DDiLoCoError):
    """The run dir's syncer state is unusable (another model layout, corruption)."""


class StoreFull(StateError):
    """The disk under the state folder is full (or over quota): the version being written is not
    durable and was not marked; nothing before it is lost. Stop serving, free space, restart."""


class StoreLocked(StateError):
    """Another syncer holds this state folder (its ``syncer.lock``)."""
