"""Rollout engines: where each step's RL samples come from (in-process, vLLM, external)."""
