"""reasoning-gym's tasks as an environment: rollout.environment = "reasoning_gym:TASK", or
"reasoning_gym" with rollout.reasoning_gym.tasks mixed by weight (pip install 'fnt[tasks]').
Pure, apart from importing reasoning_gym and reading the data files its generators use.

Prompts. A task is reasoning-gym's dataset `create_dataset(name, seed=..., size=..., **params)`,
whose item i is generated from a random generator seeded with the dataset's seed + i (the same
seed and index give the same question, on any machine). With S = rollout.reasoning_gym.seed and
N = rollout.reasoning_gym.size, each task's training prompts are its items 0..N-1 of seed S:
seeds S .. S+N-1. Its held-out prompts (rollout.reasoning_gym.val_size of them, for val/) are
the items of seed S+N in order, seeds S+N on, which the training prompts never use, leaving out
any whose question equals a training question: the run is never evaluated on a question it
trained on. The sources are mixed by weight with the run's seed as SFT mixes data sources
(fnt.data.order), so the data position resumes the prompt stream exactly.

A prompt is the chat [system, user]: the system message is rollout.reasoning_gym.system_prompt,
or for answer = "tag" reasoning-gym's own instruction to answer inside <answer></answer> (its
SYSTEM_PROMPTS["default"]) and none for answer = "text"; the user message is the item's
question. The model's template renders it.

Answers. answer = "tag": the text of the reply's last <answer>...</answer>, stripped
(reasoning_gym.utils.extract_answer); a reply without one has no answer (None), which the
scorers give 0. answer = "text": the whole reply, stripped; an empty reply has no answer. The
reward is the task's own scorer, `dataset.score_answer(answer, item)`, returned as the named
reward {task: value}: the reward is that value and reward/{task}/mean is logged per task.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from fnt.config import RolloutConfig
from fnt.config.environments import environment_kind, require_installed
from fnt.errors import ConfigError
from fnt.rollout.environments.protocol import Message, PromptSource, Reply, Start


@dataclass(frozen=True)
class Task:
    """One task of the mixture, resolved from the config."""

    name: str
    weight: float
    params_json: str  # the task's settings as a JSON object (hashable, for the cache)
    where: str  # the config key that named it, for messages

    @property
    def params(self) -> dict[str, Any]:
        return json.loads(self.params_json)


def parse_params(params: Sequence[str], where: str) -> str:
    """ "key=value" settings as a JSON object, each value read as JSON when it is JSON
    (6, true, [1, 2]) and as text otherwise."""
    pairs = []
    for param in params:
        key, eq, text = param.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"'{where}.params' has {param!r}: each is \"key=value\"")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        pairs.append((key.strip(), value))
    return json.dumps(dict(pairs), sort_keys=True)


def configured_tasks(rollout: RolloutConfig) -> tuple[Task, ...]:
    """The tasks of "reasoning_gym:TASK" or of rollout.reasoning_gym.tasks."""
    _, _, name = rollout.environment.partition(":")
    if name:
        return (Task(name, 1.0, "{}", "rollout.environment"),)
    return tuple(
        Task(
            spec.name,
            spec.weight,
            parse_params(spec.params, f"rollout.reasoning_gym.tasks[{i}]"),
            f"rollout.reasoning_gym.tasks[{i}]",
        )
        for i, spec in enumerate(rollout.reasoning_gym.tasks)
    )


def import_reasoning_gym(environment: str) -> Any:
    """The reasoning_gym module; a one-line ConfigError naming the extra when it is missing."""
    require_installed(environment_kind("reasoning_gym"), environment)
    import reasoning_gym

    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted (its extra must be installed)."""
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name != "composite")


def make_dataset(task: Task, seed: int, size: int) -> Any:
    """reasoning-gym's dataset of `task` with `seed` and `size`; ConfigError naming the key for
    an unknown task or settings it rejects."""
    import reasoning_gym

    known = task_names()
    if task.name not in known:
        close = difflib.get_close_matches(task.name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"'{task.where}': {task.name!r} is not a reasoning-gym task{hint}; "
            "fnt rl --list-environments lists them"
        )
    try:
        return reasoning_gym.create_dataset(task.name, seed=seed, size=size, **task.params)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(
            f"'{task.where}': reasoning-gym's {task.name!r} rejects its settings "
            f"{task.params}: {e or type(e).__name__}"
        ) from None


@lru_cache(maxsize=8)
def generated_items(task: Task, seed: int, start: int, count: int) -> tuple[dict, ...]:
    """Items start .. start+count-1 of the task's dataset of `seed` (each seeded seed + index);
    cached, since the training prompts are made by the rollouts and by the held-out split."""
    dataset = make_dataset(task, seed, start + count)
    return tuple(dataset[i] for i in range(start, start + count))


def task_record(task: Task, split: str, index: int, item: Mapping[str, Any]) -> dict[str, Any]:
    """The prompt record of an item: what `start` and `score` read."""
    return {
        "task": task.name,
        "split": split,
        "index": index,
        "question": item["question"],
        "answer": item["answer"],
        "item": item,
    }


def training_records(task: Task, seed: int, size: int) -> tuple[dict[str, Any], ...]:
    """The task's training prompts: items 0..size-1 of seed `seed`."""
    items = generated_items(task, seed, 0, size)
    return tuple(task_record(task, "train", i, item) for i, item in enumerate(items))


def held_out_records(task: Task, seed: int, size: int, count: int) -> tuple[dict[str, Any], ...]:
    """The task's held-out prompts: items of seed `seed + size` in order, without the ones whose
    question is a training question; ConfigError when the task cannot make `count` of them."""
    trained = {record["question"] for record in training_records(task, seed, size)}
    records: list[dict[str, Any]] = []
    # Items are generated one by one as they are indexed. Looking 2 * count + size items far is
    # enough for a task with room for both splits; one without would never end otherwise.
    limit = 2 * count + size
    dataset = make_dataset(task, seed + size, limit)
    for index in range(limit):
        if len(records) == count:
            break
        item = dataset[index]
        if item["question"] not in trained:
            trained.add(item["question"])  # no held-out question twice either
            records.append(task_record(task, "val", index, item))
    if len(records) < count:
        raise ConfigError(
            f"'{task.where}': reasoning-gym's {task.name!r} made only {len(records)} held-out "
            f"questions unlike its {size} training ones (rollout.reasoning_gym.val_size = "
            f"{count}): lower rollout.reasoning_gym.size or val_size, or widen the task's settings"
        )
    return tuple(records)


def extract_answer(reply: str, answer: str) -> Optional[str]:
    """The answer of a reply under rollout.reasoning_gym.answer (module docstring)."""
    if answer == "text":
        return reply.strip() or None
    from reasoning_gym.utils import extract_answer as last_tagged

    return last_tagged(reply)


def default_system_prompt(answer: str) -> str:
    """The system message for answer = "tag" (reasoning-gym's own) or "text" (none)."""
    if answer == "text":
        return ""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


class ReasoningGymEnvironment:
    """Single-turn episodes on reasoning-gym's generated prompts, scored by each task's own
    scorer as the named reward {task: score} (module docstring)."""

    def __init__(
        self,
        tasks: Sequence[Task],
        *,
        seed: int,
        size: int,
        val_size: int,
        answer: str,
        system_prompt: str,
    ) -> None:
        self.tasks = tuple(tasks)
        self.seed, self.size, self.val_size = seed, size, val_size
        self.answer = answer
        self.system_prompt = system_prompt or default_system_prompt(answer)
        # The datasets whose scorers score the answers (scorers do not depend on the seed).
        self.scorers = {task.name: make_dataset(task, seed, 1).score_answer for task in tasks}

    def prompt_sources(self, split: str) -> tuple[PromptSource, ...]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        sources = []
        for task in self.tasks:
            if split == "train":
                records = training_records(task, self.seed, self.size)
            else:
                records = held_out_records(task, self.seed, self.size, self.val_size)
            sources.append(PromptSource(task.name, records, task.weight))
        return tuple(sources)

    def start(self, record: Mapping[str, Any]) -> Start:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return Start((*system, {"role": "user", "content": record["question"]}))

    def respond(self, record: Mapping[str, Any], messages: Sequence[Message]) -> Optional[Reply]:
        return None

    def score(self, record: Mapping[str, Any], messages: Sequence[Message]) -> dict[str, float]:
        answer = extract_answer(messages[-1]["content"], self.answer)
        value = self.scorers[record["task"]](answer, record["item"])
        return {record["task"]: float(value)}


def build(rollout: RolloutConfig) -> ReasoningGymEnvironment:
    """The environment of rollout.environment = "reasoning_gym[:TASK]"; ConfigError for a
    missing extra, an unknown task or settings the task rejects. The prompts are generated when
    first asked for."""
    import_reasoning_gym(rollout.environment)
    rg = rollout.reasoning_gym
    return ReasoningGymEnvironment(
        configured_tasks(rollout),
        seed=rg.seed,
        size=rg.size,
        val_size=rg.val_size,
        answer=rg.answer,
        system_prompt=rg.system_prompt,
    )
