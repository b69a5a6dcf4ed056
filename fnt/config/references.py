"""The "module:function" references a config names (a reward, a custom loss), resolved. Pure,
except that resolving a reference imports its module."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


def import_function(name: str, num_args: int) -> Callable[..., Any]:
    """The function a "module:function" string names. ValueError saying what is wrong when the
    string has another form, the module cannot be imported, lacks the attribute, or the
    attribute is not callable or cannot take `num_args` positional arguments."""
    module_name, colon, attr = name.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{name!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{name!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{name!r}: {module_name}.{attr} is not callable")
    try:
        inspect.signature(fn).bind(*([None] * num_args))
    except TypeError as e:
        raise ValueError(
            f"{name!r}: {module_name}.{attr} cannot take {num_args} positional arguments ({e})"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): the call will tell
        pass
    return fn
