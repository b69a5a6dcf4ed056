"""A code-executing task run sandboxed: the model answers in a ```python block, the environment
runs that code in a worker process under a time and memory limit and scores what it prints.
Side effects: `build`'s environment executes model-written code in the process it runs in: a
worker process (rollout.isolation.workers, fnt.rollout.environments.pooled), never the trainer.
examples/sandbox/rl.toml runs it:

    [rollout]
    environment = "examples.sandbox.environment:build"
    prompts = "examples/sandbox/prompts.jsonl"   # {"prompt": ..., "answer": ...}

    [rollout.isolation]
    workers = 2
    timeout_s = 10
    memory_mb = 1024

Code that crashes its worker (os._exit, a segfault), sleeps or loops past the time limit, or
allocates past the memory limit costs only its episode: it is worth 0 and counted in
rollout/env_failures. Code that raises, or prints the wrong thing, scores 0 as an ordinary
wrong answer.
"""

from __future__ import annotations

import contextlib
import io
import re

from fnt.rollout.environments import Start

SYSTEM = "Answer with a Python program in a ```python code block that prints the answer."
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def program_of(text: str) -> str:
    """The last ```python block of a model turn ("" when there is none)."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else ""


def run_program(code: str) -> str:
    """What `code` prints; the text of its exception's type when it raises."""
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            exec(compile(code, "<model>", "exec"), {"__name__": "__sandbox__"})
    except Exception as e:  # the model's code failed: a wrong answer, not a broken sandbox
        return f"{type(e).__name__}"
    return output.getvalue()


class SandboxEnvironment:
    """One model turn; the reward is 1.0 when the program's output, stripped, is the record's
    "answer", else 0.0."""

    def start(self, record):
        return Start(
            ({"role": "system", "content": SYSTEM}, {"role": "user", "content": record["prompt"]})
        )

    def respond(self, record, messages):
        return None

    def score(self, record, messages):
        turn = messages[-1]  # "text" is the whole turn; start-up's trial turn has "content"
        printed = run_program(program_of(turn.get("text", turn.get("content", ""))))
        return 1.0 if printed.strip() == str(record["answer"]).strip() else 0.0


def build(rollout):
    """The environment itself; run it only in workers (rollout.isolation.workers > 0: it
    executes the model's code). A run's config that would build it in the trainer's process is
    refused; a server builds it with rollout None (run the server with --workers)."""
    if rollout is not None and rollout.isolation.workers == 0:
        raise ValueError(
            "it runs model-written code: run it in worker processes, [rollout.isolation] "
            "workers = 2 (examples/sandbox/rl.toml)"
        )
    return SandboxEnvironment()
