"""The "module:function" references a config names (a reward, a custom loss, a monitor, an
environment), resolved and checked. Pure, except that resolving a reference imports its module.

`require_function` is the up-front check every such key goes through (validation for
loss.custom and monitors, the preflight for rollout.reward and rollout.environment): a
ConfigError naming the key, what is wrong and the shape expected, before any model is built.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from fnt.errors import ConfigError, named

# What rollout.environment must name (its messages say so; fnt.rollout.environments calls it).
ENVIRONMENT_SHAPE = "a factory fn(rollout) returning an environment (fnt.rollout.environments)"


def import_function(name: str, num_args: int) -> Callable[..., Any]:
    """The function a "module:function" string names. ValueError saying what is wrong (without
    repeating `name`, which the caller's message shows) when the string has another form, the
    module cannot be imported (or raises while it is), lacks the attribute, or the attribute is
    not callable or cannot take `num_args` positional arguments."""
    module_name, colon, attr = name.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError("is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r}: {e}") from e
    except Exception as e:  # the user's module failed while importing: still their input
        raise ValueError(
            f"cannot import module {module_name!r}: it raised {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{module_name}.{attr} is not callable")
    try:
        inspect.signature(fn).bind(*([None] * num_args))
    except TypeError as e:
        raise ValueError(
            f"{module_name}.{attr} cannot take {num_args} positional arguments ({e})"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): the call will tell
        pass
    return fn


def require_function(name: str, key: str, num_args: int, expected: str) -> Callable[..., Any]:
    """`import_function(name, num_args)` for the config key `key`, or a ConfigError naming the
    key, what is wrong and the `expected` shape (`"a reward fn(completion, sample) -> float"`)."""
    try:
        return import_function(name, num_args)
    except ValueError as e:
        raise ConfigError(f"{named(key, name)}: {e}; expected {expected}") from None
