"""The errors fnt raises for bad input. Pure: no side effects.

All three are user errors, not bugs: the command line prints their message and exits with status 2,
without a traceback. Config, data and rollout code all import them from here, so none of those
modules has to reach into another to name them.
"""


class ConfigError(ValueError):
    """A bad key or value; the message names the key, its source and what was expected."""


class DataError(ValueError):
    """A data file that cannot be used; the message names the file (and the line)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, unreadable) or written (the disk is full); the
    message names the file or directory and what to do."""
