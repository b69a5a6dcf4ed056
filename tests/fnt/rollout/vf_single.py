"""A single-turn verifiers taskset written in verifiers' own style (verifiers.v1): reverse a
word; rewards: the exact reversal (weight 1) and the share of letters (weight 0.5). For
rollout.environment = "verifiers:tests.fnt.rollout.vf_single" (needs the verifiers extra)."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ["stone", "river", "cloud", "ember", "frost", "maple", "orbit", "lunar"]


class ReverseData(vf.TaskData):
    answer: str
    """The word reversed."""


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def letters(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(c.isalpha() for c in reply) / len(reply) if reply else 0.0

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many words."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        return [
            ReverseTask(
                ReverseData(
                    prompt=f"Reverse the word: {word}",
                    system_prompt="Answer with the reversed word only.",
                    answer=word[::-1],
                ),
                self.config.task,
            )
            for word in WORDS[: self.config.num_tasks]
        ]


__all__ = ["ReverseTaskset"]
