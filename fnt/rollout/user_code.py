"""The user's own code (rewards, environments and their factories) called so that its failures
are told in one line. Pure, except for what the user's functions do when called, and for the
event loop thread that runs the coroutines of async ones (started on the first, it lives as long
as the process).

A user's function that raises, or returns what its protocol does not allow, becomes a
UserCodeError (fnt.errors): a first line naming the function, the exception or the value, and
the sample, then only the traceback frames that are the user's own (not fnt's, Python's or an
installed package's), so the message points at the user's line and at nothing else. A raised
exception is a `UserCodeRaised`, which rollout.on_bad_reward = "skip" may skip during training
(fnt.rollout.environments.episodes); a wrong return type always stops the run.

A user's function may be async (`async def respond(...)`, an environment that awaits a sandbox
or a server): its coroutine runs to its end on fnt's one event loop, in a thread of its own, and
the caller waits for it, so every async call of a run shares one loop (a client session opened in
one call works in the next) and calls from several threads run concurrently there.

fnt.apps.preflight's `try_user_code` calls what scores a run's episodes once on its first
prompt record before any model is built, so such a failure costs seconds instead of a model
load and a sampled step.
"""

from __future__ import annotations

import asyncio
import inspect
import sysconfig
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from fnt.errors import UserCodeError

# fnt's own code and the steps beside it: their frames are never the user's.
FNT_DIRS = (Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2] / "steps")
# Python's and installed packages' frames are not the user's either (a reward that calls numpy).
LIBRARY_DIRS = tuple(
    Path(path).resolve()
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (path := sysconfig.get_paths().get(key))
)


class UserCodeRaised(UserCodeError):
    """The user's function raised (rather than returned a value it may not)."""


def is_users(filename: str) -> bool:
    """Whether a frame's file is the user's: not under fnt, steps, Python or site-packages."""
    path = Path(filename).resolve()
    return not any(path.is_relative_to(root) for root in FNT_DIRS + LIBRARY_DIRS)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of `exc`'s traceback that are the user's own (`is_users`), outermost first;
    the chained exceptions' are not followed."""
    return [f for f in traceback.extract_tb(exc.__traceback__) if is_users(f.filename)]


def one_line(text: str) -> str:
    """`text` on one line (a message's first line must stay one). Pure."""
    return " ".join(str(text).split())


def describe(exc: BaseException) -> str:
    """`ZeroDivisionError: division by zero`, on one line. Pure."""
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def shown(value: Any, limit: int = 80) -> str:
    """`value`'s repr, cut to about `limit` characters. Pure."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raised(what: str, exc: BaseException) -> UserCodeRaised:
    """The error for a user's function that raised `exc`: `what` ("reward 'x' failed on ...",
    naming the function and the sample) and the exception on the first line, then the user's
    frames."""
    frames = "".join(traceback.format_list(user_frames(exc))).rstrip("\n")
    return UserCodeRaised(f"{what}: {describe(exc)}" + (f"\n{frames}" if frames else ""))


def call_user(
    fn: Callable[..., Any], what: str, *args: Any, passes: tuple[type[Exception], ...] = ()
) -> Any:
    """fn(*args); an exception it raises becomes `raised(what, exc)` (a UserCodeError it raised,
    already told, and one of the types `passes` names, pass as they are)."""
    try:
        result = fn(*args)
        return run_coroutine(result) if inspect.isawaitable(result) else result
    except (UserCodeError, *passes):
        raise
    except Exception as exc:
        raise raised(what, exc) from None


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """fnt's event loop for async user code, running in a daemon thread started on first use."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="fnt-user-async", daemon=True).start()
            _LOOP = loop
        return _LOOP


def run_coroutine(awaitable: Any) -> Any:
    """The result of `awaitable` run on fnt's event loop; the calling thread waits for it (it
    must not be the loop's own thread). What it raises is raised here."""

    async def wrapped() -> Any:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wrapped(), event_loop()).result()
