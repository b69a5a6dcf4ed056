"""An environment run in worker processes, out of the trainer's: a crash, a hang or a blown
memory limit costs the episode whose call it was, not the run. Side effects: starts, kills and
replaces worker processes (multiprocessing, "spawn" context), which import the inner
environment's module and call its factory.

`PooledEnvironment(factory, rollout, ...)` is an environment (fnt.rollout.environments.protocol)
that forwards every call to one of `workers` processes: the next free one, in turn, so calls
from several threads (rollout.env_concurrency) run in as many workers at once, and a call waits
while all are busy. A call may reach any worker, so the inner environment keeps nothing between
calls that another worker would need (the protocol hands it the record and the messages each
time). Each worker builds the inner
environment once, as factory(rollout), then limits its address space to what it has plus
`memory_mb` (resource.RLIMIT_AS; 0: no limit; Linux), and answers calls one at a time. A call
that gets no answer within `timeout_s`, or whose worker dies (os._exit, a segfault, the memory
limit), kills that worker, starts a new one in its place and raises `EnvironmentFailed`: the
episode ends and gets the environment's `failure_reward`, and rollout/env_failures counts it
(fnt.rollout.environments.episodes). An exception the inner environment raises is its bug, as
in process: it reaches the trainer as the environment's error and stops the run.

Workers are started with "spawn", not fork: the trainer has torch's threads, and a forked child
of a threaded process may hang on a lock held at the fork. The inner environment's results
cross a pipe, so they must be picklable (Start, Reply, floats and dicts are).

Determinism: a healthy pooled environment answers exactly as the inner one in process does, so
a resumed run replays its steps exactly; a timeout depends on the machine's speed, so exact
replay holds only for runs in which no call failed.

A run chooses it in its config: rollout.isolation.workers > 0 runs rollout.environment (or each
member of rollout.environments) in a pool, with rollout.isolation's timeout_s, memory_mb and
failure_reward (fnt.rollout.environments.environment_of). A factory of your own may build one
too: `PooledEnvironment("my_module:build", rollout, timeout_s=10, memory_mb=1024)`.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from fnt.rollout.environments.protocol import EnvironmentFailed

# Calls the worker answers; anything else is refused.
FORWARDED = ("start", "respond", "score", "score_turns", "prompt_sources")


def worker_main(connection, factory: str, rollout: Any, memory_mb: int) -> None:
    """A worker's loop: build the environment, limit its address space to what it has plus
    `memory_mb`, then answer (method, args) with ("ok", value) or ("raised", text) until the
    pipe closes."""
    from fnt.config.references import import_function

    try:
        environment = import_function(factory, 1)(rollout)
    except Exception as e:
        connection.send(("raised", f"the factory {factory!r} failed: {type(e).__name__}: {e}"))
        return
    if memory_mb > 0:
        limit_address_space(memory_mb)
    connection.send(("ok", describe(environment)))
    while True:
        try:
            method, args = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", getattr(environment, method)(*args)))
        except MemoryError:
            return  # the limit was hit: die, and the caller sees a failed call
        except Exception as e:
            connection.send(("raised", f"{type(e).__name__}: {e}"))


def limit_address_space(memory_mb: int) -> None:
    """RLIMIT_AS at this process's address space now plus `memory_mb` (the worker's Python and
    imports, torch's among them, are already mapped: the limit is on what the calls add)."""
    import os
    import resource

    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = size + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def describe(environment: Any) -> dict[str, Any]:
    """What the trainer needs to know of the inner environment besides its methods."""
    return {
        "methods": [m for m in FORWARDED if callable(getattr(environment, m, None))],
        "reward_weights": dict(getattr(environment, "reward_weights", None) or {}),
        "keep_special_tokens": bool(getattr(environment, "keep_special_tokens", True)),
    }


class Worker:
    """One worker process and the trainer's end of its pipe."""

    def __init__(self, factory: str, rollout: Any, memory_mb: int, timeout_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=worker_main, args=(child, factory, rollout, memory_mb), daemon=True
        )
        self.process.start()
        child.close()
        self.factory, self.timeout_s = factory, timeout_s
        self.ready: Optional[dict[str, Any]] = None

    def wait_ready(self, start_timeout_s: float) -> dict[str, Any]:
        """The inner environment's description once the worker has built it; RuntimeError when
        the factory raised, EnvironmentFailed when the worker died or did not start in time."""
        if self.ready is None:
            status, value = self.receive(start_timeout_s, "start")
            if status == "raised":
                raise RuntimeError(value)
            self.ready = value
        return self.ready

    def receive(self, timeout_s: float, what: str) -> tuple[str, Any]:
        try:
            if self.connection.poll(timeout_s):
                return self.connection.recv()
            reason = f"no answer to {what} within {timeout_s:g} s"
        except (EOFError, OSError):
            reason = f"the worker died during {what} (exit code {self.exit_code()})"
        self.stop()
        raise EnvironmentFailed(reason)

    def exit_code(self) -> Optional[int]:
        self.process.join(1.0)
        return self.process.exitcode

    def call(self, method: str, args: tuple) -> Any:
        try:
            self.connection.send((method, args))
        except (BrokenPipeError, OSError):
            self.stop()
            raise EnvironmentFailed(f"the worker died before {method}") from None
        status, value = self.receive(self.timeout_s, method)
        if status == "raised":
            raise RuntimeError(value)
        return value

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.connection.close()


class PooledEnvironment:
    """The environment `factory` ("module:factory") builds, run in `workers` processes (module
    docstring); `failure_reward` is what an episode whose call failed is worth."""

    def __init__(
        self,
        factory: str,
        rollout: Any,
        *,
        workers: int = 1,
        timeout_s: float = 30.0,
        memory_mb: int = 0,
        start_timeout_s: float = 120.0,
        failure_reward: float = 0.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"PooledEnvironment: workers = {workers}: must be at least 1")
        if not timeout_s > 0:
            raise ValueError(f"PooledEnvironment: timeout_s = {timeout_s}: must be > 0")
        self.factory, self.rollout = factory, rollout
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.start_timeout_s = start_timeout_s
        self.failure_reward = float(failure_reward)
        self.failures = 0
        self.closed = False
        self.counting = threading.Lock()  # failures is counted from several threads
        self.workers = [self.new_worker() for _ in range(workers)]
        self.idle: queue.SimpleQueue[int] = queue.SimpleQueue()  # free workers, first in first
        for index in range(workers):
            self.idle.put(index)
        description = self.workers[0].wait_ready(start_timeout_s)
        self.reward_weights = description["reward_weights"]
        self.keep_special_tokens = description["keep_special_tokens"]
        self.methods = set(description["methods"])
        for optional in ("score_turns", "prompt_sources"):
            if optional not in self.methods:
                setattr(self, optional, None)  # the engines test callable(getattr(...))

    def new_worker(self) -> Worker:
        return Worker(self.factory, self.rollout, self.memory_mb, self.timeout_s)

    def call(self, method: str, *args: Any) -> Any:
        """`method`(*args) in the next free worker (waiting for one while all are busy);
        EnvironmentFailed (the worker replaced) when it died or timed out. Thread-safe: a
        worker serves one call at a time, the one that took it from `idle`."""
        index = self.idle.get()
        try:
            worker = self.workers[index]
            try:
                worker.wait_ready(self.start_timeout_s)
                return worker.call(method, args)
            except EnvironmentFailed:
                with self.counting:
                    self.failures += 1
                self.workers[index] = self.new_worker()
                raise
        finally:
            self.idle.put(index)

    def start(self, record: Mapping[str, Any]):
        return self.call("start", dict(record))

    def respond(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        return self.call("respond", dict(record), [dict(m) for m in messages])

    def score(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        return self.call("score", dict(record), [dict(m) for m in messages])

    def score_turns(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        return self.call("score_turns", dict(record), [dict(m) for m in messages])

    def prompt_sources(self, split: str):
        return self.call("prompt_sources", split)

    def close(self) -> None:
        """Stop every worker (they are daemons: they also end with the trainer)."""
        self.closed = True
        for worker in self.workers:
            worker.stop()
