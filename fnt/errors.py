"""The errors fnt raises for bad input (and for an inference server that fails). Pure: no side
effects.

The first three and UserCodeError are user errors, not bugs: the command line prints their
message and exits with status 2, without fnt's traceback. Config, data and rollout code all
import them from here, so none of those modules has to reach into another to name them; `named`
is how their messages name the key, option or argument they are about.
"""


class ConfigError(ValueError):
    """A bad key or value; the message names the key, its source and what was expected."""


class DataError(ValueError):
    """A data file that cannot be used; the message names the file (and the line)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, unreadable) or written (the disk is full); the
    message names the file or directory and what to do."""


class UserCodeError(ValueError):
    """The user's own function (a reward, an environment or its factory) raised or returned what
    its protocol does not allow; the message's first line names the function, the exception or
    value and the sample, the lines after it are the user's own frames (fnt.rollout.user_code).
    The command line prints it after `error:` and exits with status 2, like the three above."""


class ServerError(RuntimeError):
    """An inference server that is down, too slow or answers with an error, after the retries;
    the message names the server and the request. The command line prints it on one line and
    exits with status 3: the run resumes from its last checkpoint once the server is back."""


def named(key: str, value: object) -> str:
    """How a message names the input it is about: `'model.name' = 'x'` for a config key,
    `--out 'x'` for a command-line option, `'x'` for a positional argument (key ""). Pure."""
    shown = repr(str(value))
    if not key:
        return shown
    return f"{key} {shown}" if key.startswith("-") else f"'{key}' = {shown}"
