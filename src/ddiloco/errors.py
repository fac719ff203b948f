"""User-facing errors: each carries one line that says what is wrong and what to do."""


class DDiLoCoError(Exception):
    """Base class for errors a user can cause; the CLI prints the message alone, no trace."""


class ConfigError(DDiLoCoError):
    """A configuration value is unknown, out of range or inconsistent."""


class DataError(DDiLoCoError):
    """A dataset or data package is missing or unusable."""
