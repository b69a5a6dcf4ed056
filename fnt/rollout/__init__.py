"""RL rollouts: prompts -> sampled completions -> rewards -> group advantages -> packed RLBatch.
Pure except the engine (fnt.rollout.engine), which loads a model copy, syncs it from the policy,
generates and all-reduces metrics, and load_prompts, which reads the prompts file.

    load_prompts, prompt_order, step_prompts (prompts), rank_share (fnt.parallel)
    -> generate (generate) -> score (fnt.rewards) -> group_advantages (advantages)
    -> pack_rollouts (pack) -> RLBatch per rank (InProcessEngine.rollout)
"""

from fnt.rollout.advantages import group_advantages
from fnt.rollout.engine import (
    InProcessEngine,
    check_prompt_lengths,
    reward_metrics,
    rollout_metrics,
    score_groups,
)
from fnt.rollout.generate import Completion, generate, sampling_seed
from fnt.rollout.pack import RolloutSample, first_fit, pack_rollouts
from fnt.rollout.prompts import (
    Prompt,
    load_prompts,
    prompt_messages,
    prompt_order,
    render_prompt,
    step_prompts,
)

__all__ = [
    "Completion",
    "InProcessEngine",
    "Prompt",
    "RolloutSample",
    "check_prompt_lengths",
    "first_fit",
    "generate",
    "group_advantages",
    "load_prompts",
    "pack_rollouts",
    "prompt_messages",
    "prompt_order",
    "render_prompt",
    "reward_metrics",
    "score_groups",
    "rollout_metrics",
    "sampling_seed",
    "step_prompts",
]
