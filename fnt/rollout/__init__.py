"""RL rollouts: prompts -> sampled completions -> rewards -> group advantages -> packed RLBatch.
Side effects: the engines' (fnt.rollout.engines: an inference copy of the model, generation, HTTP
to vLLM servers, collectives), reading the prompts (prompts, base), saving sample files
(saved_samples), publishing weights (publish), sampling (sampling) and importing the rewards and
environments a config names (rewards, environments); advantages and pack are pure. This file
only re-exports names, each imported from its module on first use.

    load_prompts, prompt_order, step_prompts (prompts), rank_share (fnt.distributed.parallel)
    -> run_episodes (environments.episodes: batched turns of generate (sampling), the
       environment's replies rendered token-exact (environments.render))
    -> scored_samples (the environment's score, group_advantages) -> RolloutSample (pack)
    -> pack_rollouts (pack) -> RLBatch per rank (InProcessEngine.rollout)

Each name below is loaded on first use, so that importing one rollout module (the config's
validation imports fnt.rollout.rewards) does not load the engines.
"""

from importlib import import_module

_EXPORTS = {
    "Completion": "fnt.rollout.sampling",
    "InProcessEngine": "fnt.rollout.engines.in_process",
    "Prompt": "fnt.rollout.prompts",
    "RolloutSample": "fnt.rollout.pack",
    "check_prompt_lengths": "fnt.rollout.base",
    "first_fit": "fnt.rollout.pack",
    "generate": "fnt.rollout.sampling",
    "group_advantages": "fnt.rollout.advantages",
    "load_prompts": "fnt.rollout.prompts",
    "pack_rollouts": "fnt.rollout.pack",
    "prompt_messages": "fnt.rollout.prompts",
    "prompt_order": "fnt.rollout.prompts",
    "render_prompt": "fnt.rollout.prompts",
    "reward_metrics": "fnt.rollout.base",
    "rollout_metrics": "fnt.rollout.base",
    "sampling_seed": "fnt.rollout.sampling",
    "single_turn": "fnt.rollout.pack",
    "step_prompts": "fnt.rollout.prompts",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fnt.rollout' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
