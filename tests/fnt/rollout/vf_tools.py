"""A tool-using verifiers taskset written in verifiers' own style (verifiers.v1): sums to work
out with a calculator toolset; rewards: the right answer (weight 1), a tool used (weight
0.25) and an answer of digits (weight 0.1). For rollout.environment =
"verifiers:tests.fnt.rollout.vf_tools" (needs the verifiers extra)."""

from __future__ import annotations

import verifiers.v1 as vf

SUMS = [(17, 25), (3, 4), (120, 7), (9, 9)]


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first addend
            b: the second addend
        """
        return a + b

    @vf.tool
    def fail(self, reason: str) -> str:
        """Always fails."""
        raise RuntimeError(f"failed: {reason}")


class SumData(vf.TaskData):
    answer: str


class SumTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.tool_calls for m in trace.assistant_messages))

    @vf.reward(weight=0.1)
    async def digits(self, trace: vf.Trace) -> float:
        """The answer's format: the share of its characters that are digits."""
        reply = trace.last_reply
        return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0


class SumConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [
            SumTask(SumData(prompt=f"What is {a} + {b}?", answer=str(a + b)), self.config.task)
            for a, b in SUMS
        ]


__all__ = ["SumTaskset"]
