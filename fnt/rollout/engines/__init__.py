"""Rollout engines: where each step's RL samples come from (in-process, vLLM, external).
Side effects: each engine's, named in its module (an inference copy of the model and its
generation, HTTP to vLLM servers, reading {output_dir}/rollouts/, collectives); this file holds
no code."""
