"""`fnt show-rollouts --config rl.toml [--step N] [--n 3] [--key=value]...`: a few trajectories of
RL step N as the in-process engine samples them from model.name, sampled tokens marked. Side
effects: loads the model, tokenizer and prompts, samples, prints.

A run's step N draws from seeds of (seed, N, the prompt's slot) and takes the prompts the
prompt order gives step N, so this shows exactly the episodes step N of a run whose policy is
model.name (the base model for step 1; an exported checkpoint step_{N-1} for later steps) has
sampled, through the same code (fnt.rollout.environments.episodes): the environment's turns,
limits and scoring. Each trajectory is the text of its tokens decoded run by run: context
(prompt, tool results, feedback, template text) as it is, tokens the policy sampled between
`[[` and `]]` (green on a terminal), after a header with its prompt's line, reward, advantage,
turns, tool calls and errors, truncation and token counts.
"""

from __future__ import annotations

import argparse
import sys

from fnt.apps.show_data import marked_text, runs


def trajectory_header(where: str, sample) -> str:
    """`== prompt line 3: reward 0.5, advantage 0.71, 2 turns, ...; 40 tokens (...)`. Pure."""
    sampled = sum(sample.sampled)
    facts = [
        f"reward {sample.reward:.3g}",
        f"advantage {sample.advantage:.3g}",
        f"{sample.turns} turn{'s' if sample.turns != 1 else ''}",
    ]
    if sample.tool_calls or sample.tool_errors:
        facts.append(f"{sample.tool_calls} tool calls ({sample.tool_errors} failed)")
    if sample.truncated:
        facts.append("truncated")
    named = ", ".join(f"{name} {value:.3g}" for name, value in sample.named_rewards)
    if named:
        facts.append(f"rewards: {named}")
    return (
        f"== {where}: {', '.join(facts)}; {len(sample.token_ids)} tokens "
        f"({sampled} sampled, {len(sample.token_ids) - sampled} context)"
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fnt show-rollouts",
        description="Print a few trajectories of an RL step, sampled tokens marked.",
        epilog="Other options are config keys, as for `fnt rl` (e.g. --rollout.max-turns 3).",
        allow_abbrev=False,
    )
    parser.add_argument("--step", type=int, default=1, help="the step to sample (default 1)")
    parser.add_argument("--n", type=int, default=3, help="how many trajectories (default 3)")
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="green sampled tokens instead of [[...]] (auto: on a terminal)",
    )
    args, rest = parser.parse_known_args(argv)
    from fnt.apps.cli import parse_config
    from fnt.apps.preflight import check_rollout_inputs
    from fnt.config import ConfigError, RLConfig

    config, model_name_source = parse_config(rest, RLConfig)
    if args.step < 1 or args.n < 1:
        raise ConfigError(f"--step and --n must be >= 1, got {args.step} and {args.n}")
    check_rollout_inputs(config, model_name_source)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    show(config, args.step, args.n, color)


def show(config, step: int, n: int, color: bool) -> None:
    """Print `n` trajectories of step `step` sampled from config.model.name (one process)."""
    from fnt.batch import DataPosition
    from fnt.dist.runtime import setup_trainer, teardown_trainer
    from fnt.rollout.engines.in_process import InProcessEngine

    runtime = setup_trainer(config)
    try:
        engine = InProcessEngine(config, runtime)
        position = DataPosition()
        for _ in range(step - 1):
            _, position = engine.step_prompts(position)
        ids, _ = engine.step_prompts(position)
        samples, dropped, _ = engine.sample(engine.model, step, position, step - 1)
        engine.close()
    finally:
        teardown_trainer(runtime)
    group = config.rollout.group_size
    # Samples come in prompt order, group by group; dropped episodes leave gaps.
    wheres = (
        [f"prompt line {engine.prompts[ids[i // group]].line}" for i in range(len(ids) * group)]
        if not dropped
        else [f"trajectory {i + 1}" for i in range(len(samples))]
    )
    print(
        f"step {step}: {len(samples)} trajectories of {len(ids)} prompts x {group} "
        f"({dropped} dropped as truncated); showing {min(n, len(samples))}"
    )
    for sample, where in list(zip(samples, wheres))[:n]:
        print(trajectory_header(where, sample))
        pieces = [
            (engine.tokenizer.decode(run), sampled)
            for run, sampled in runs(sample.token_ids, sample.sampled)
        ]
        print(marked_text(pieces, color))
