"""User-facing errors: each carries one line that says what is wrong and what to do."""


class DDiLoCoError(Exception):
    """Base class for errors a user can cause; the CLI prints the message alone, no trace."""


class ConfigError(DDiLoCoError):
    """A configuration value is unknown, out of range or inconsistent."""


class DataError(DDiLoCoError):
    """A dataset or data package is missing or unusable."""


def require(ok: bool, key: str, value: object, allowed: str) -> None:
    """The one way configs are validated: raise ConfigError naming the key, its value and what
    is allowed (``error: algo.overlap = 30 is out of range; allowed: 0 <= overlap < 24``)."""
    if not ok:
        raise ConfigError(f"{key} = {value!r} is out of range; allowed: {allowed}")


def require_one_of(key: str, value: object, choices: tuple[object, ...]) -> None:
    """``require`` for a field of a few allowed values (a ``Literal`` type's ``get_args``):
    ``error: algo.merge = 'x' is out of range; allowed: one of ('rda', 'mean')``."""
    require(value in choices, key, value, f"one of {choices}")


class UsageError(DDiLoCoError):
    """The library API was called wrongly (a model whose shapes changed, ``step()`` after
    ``close()``, an argument of the wrong kind)."""


class RefusedError(DDiLoCoError):
    """The syncer refused this learner (for example a model or layout that differs from the
    syncer's); the reason is the syncer's own words."""


class CommError(DDiLoCoError):
    """A learner's comm thread died: the learner must not train on alone, unnoticed."""
