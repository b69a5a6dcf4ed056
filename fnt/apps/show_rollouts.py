"""`fnt show-rollouts --config rl.toml [--step N] [--n 3] [--key=value]...`: a few trajectories of
RL step N as the in-process engine samples them from model.name, sampled tokens marked.
`fnt show-rollouts --run DIR [--step N] [--n 3]`: the first trajectories a run saved for step N
(DIR/samples/step_N.jsonl; the last saved step by default), trained tokens marked. Side
effects: loads the model, tokenizer and prompts, samples, prints; with --run, reads the run's
config.json, the samples file and the tokenizer of the run's model.name, prints.

A run's step N draws from seeds of (seed, N, the prompt's slot) and takes the prompts the
prompt order gives step N, so this shows exactly the episodes step N of a run whose policy is
model.name (the base model for step 1; an exported checkpoint step_{N-1} for later steps) has
sampled, through the same code (fnt.rollout.environments.episodes): the environment's turns,
limits and scoring. Each trajectory is the text of its tokens decoded run by run: context
(prompt, tool results, feedback, template text) as it is, tokens the policy sampled between
`[[` and `]]` (green on a terminal), after a header with its prompt's line, reward, advantage,
turns, tool calls and errors, truncation (a length cut) or running out of turns, and token
counts. A saved step shows what that run trained, from the file alone: each line's `token_ids`
decoded in the runs its `trained` spans cut, under a header with the line's facts; a file saved
before lines had `token_ids` shows its prompt and completion text unmarked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from fnt.apps.show_data import marked_text, runs


def episode_facts(
    reward: Optional[float],
    advantage: Optional[float],
    turns: int,
    *,
    tool_calls: int = 0,
    tool_errors: int = 0,
    truncated: bool = False,
    out_of_turns: bool = False,
    named: Sequence[tuple[str, Optional[float]]] = (),
) -> list[str]:
    """`reward 0.5`, `advantage 0.71`, `2 turns`, ...: a header's facts of an episode. Pure."""

    def number(value: Optional[float]) -> str:
        return "nan" if value is None else f"{value:.3g}"

    facts = [
        f"reward {number(reward)}",
        f"advantage {number(advantage)}",
        f"{turns} turn{'s' if turns != 1 else ''}",
    ]
    if tool_calls or tool_errors:
        facts.append(f"{tool_calls} tool calls ({tool_errors} failed)")
    if truncated:
        facts.append("truncated")
    if out_of_turns:
        facts.append("out of turns")
    rewards = ", ".join(f"{name} {number(value)}" for name, value in named)
    if rewards:
        facts.append(f"rewards: {rewards}")
    return facts


def token_counts(total: int, sampled: int) -> str:
    """`40 tokens (12 sampled, 28 context)`. Pure."""
    return f"{total} tokens ({sampled} sampled, {total - sampled} context)"


def trajectory_header(where: str, sample) -> str:
    """`== prompt line 3: reward 0.5, advantage 0.71, 2 turns, ...; 40 tokens (...)`. Pure."""
    facts = episode_facts(
        sample.reward,
        sample.advantage,
        sample.turns,
        tool_calls=sample.tool_calls,
        tool_errors=sample.tool_errors,
        truncated=sample.truncated,
        out_of_turns=sample.out_of_turns,
        named=sample.named_rewards,
    )
    tokens = token_counts(len(sample.token_ids), sum(sample.sampled))
    return f"== {where}: {', '.join(facts)}; {tokens}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fnt show-rollouts",
        description="Print a few trajectories of an RL step, sampled tokens marked: sampled now "
        "from --config's model, or as a run saved them (--run).",
        epilog="Other options are config keys, as for `fnt rl` (e.g. --rollout.max-turns 3); "
        "--run takes none.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--run",
        type=Path,
        metavar="DIR",
        help="show a step a run saved (DIR/samples/step_N.jsonl) instead of sampling one",
    )
    parser.add_argument(
        "--step",
        type=int,
        help="the step to sample (default 1), or with --run the saved step (default the last)",
    )
    parser.add_argument("--n", type=int, default=3, help="how many trajectories (default 3)")
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="green sampled tokens instead of [[...]] (auto: on a terminal)",
    )
    args, rest = parser.parse_known_args(argv)
    from fnt.config import ConfigError

    if (args.step is not None and args.step < 1) or args.n < 1:
        raise ConfigError(f"--step and --n must be >= 1, got {args.step} and {args.n}")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    if args.run is not None:
        if rest:
            raise ConfigError(
                f"--run shows what a run saved, with its own config: {' '.join(rest)} would "
                "not apply (config options are for sampling a step with --config)"
            )
        show_saved(args.run, args.step, args.n, color)
        return
    from fnt.apps.cli import parse_config
    from fnt.apps.preflight import check_rollout_inputs
    from fnt.config import RLConfig

    config, model_name_source = parse_config(rest, RLConfig)
    check_rollout_inputs(config, model_name_source)
    show(config, args.step or 1, args.n, color)


def show(config, step: int, n: int, color: bool) -> None:
    """Print `n` trajectories of step `step` sampled from config.model.name (one process)."""
    from fnt.batch import DataPosition
    from fnt.distributed.runtime import setup_trainer, teardown_trainer
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


def saved_header(record: Mapping[str, Any]) -> str:
    """`== sample 3 (rank 0): reward 0.5, ...; 40 tokens (12 sampled, 28 context)` of a saved
    line (fnt.rollout.saved_samples.sample_record); a line without `token_ids` counts only its
    sampled tokens. Pure."""
    facts = episode_facts(
        record.get("reward"),
        record.get("advantage"),
        record.get("turns", 1),
        truncated=bool(record.get("truncated")),
        out_of_turns=bool(record.get("out_of_turns")),
        named=sorted((record.get("rewards") or {}).items()),
    )
    sampled = record.get("completion_tokens", 0)
    ids = record.get("token_ids")
    tokens = token_counts(len(ids), sampled) if ids is not None else f"{sampled} sampled tokens"
    return (
        f"== sample {record.get('index')} (rank {record.get('rank')}): {', '.join(facts)}; {tokens}"
    )


def trained_mask(record: Mapping[str, Any], where: str) -> list[bool]:
    """The per-token trained flags of a saved line's `token_ids` from its `trained` spans;
    DataError naming `where` for spans that are not in order within the tokens. Pure."""
    from fnt.errors import DataError

    ids, spans = record["token_ids"], record.get("trained")
    bad = DataError(
        f"{where}: 'trained' must be [start, end) spans in order within its {len(ids)} "
        f"token_ids, at least one, got {spans!r}"
    )
    if not isinstance(spans, list) or not spans:
        raise bad
    mask, end = [False] * len(ids), 0
    for span in spans:
        if not (
            isinstance(span, list)
            and len(span) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
            and end <= span[0] < span[1] <= len(ids)
        ):
            raise bad
        start, end = span
        mask[start:end] = [True] * (end - start)
    return mask


def saved_pieces(record: Mapping[str, Any], tokenizer: Any, where: str) -> list[tuple[str, bool]]:
    """A saved line as (text, trained) pieces: its token_ids decoded run by run, the runs cut
    where its `trained` spans start and end; a line without token_ids (saved before they were)
    is its prompt and completion text, unmarked. Pure but for the tokenizer."""
    if record.get("token_ids") is None:
        return [(record.get("prompt", "") + record.get("completion", ""), False)]
    ids = record["token_ids"]
    return [
        (tokenizer.decode(run), trained) for run, trained in runs(ids, trained_mask(record, where))
    ]


def show_saved(run_dir: Path, step: Optional[int], n: int, color: bool) -> None:
    """Print the first `n` trajectories run `run_dir` saved for step `step` (the last saved
    step when None), with the tokenizer of the run's model.name (its config.json)."""
    from fnt.errors import ConfigError, DataError, named
    from fnt.store.rundir import CONFIG_FILE
    from fnt.store.samples import read_step_samples, samples_path, saved_sample_steps

    if not run_dir.is_dir():
        raise ConfigError(f"{named('--run', run_dir)}: not a directory (a run's output_dir)")
    steps = saved_sample_steps(run_dir)
    if step is None and not steps:
        raise DataError(
            f"{run_dir}: no saved samples (samples/step_N.jsonl; rollout.log_samples_every)"
        )
    step = steps[-1] if step is None else step
    path = samples_path(run_dir, step)
    try:
        records = read_step_samples(run_dir, step)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON lines ({e})") from None
    if records is None:
        saved = ", ".join(map(str, steps)) or "none"
        raise DataError(f"{path}: no such file; the steps saved are: {saved}")
    tokenizer = None
    if any(r.get("token_ids") is not None for r in records[:n]):
        tokenizer = run_tokenizer(run_dir / CONFIG_FILE)
    policy = {r.get("policy_step") for r in records} - {None}
    sampled_by = f", sampled by policy step {min(policy)}" if len(policy) == 1 else ""
    print(
        f"step {step}: {len(records)} trajectories saved in {path}{sampled_by}; "
        f"showing {min(n, len(records))}"
    )
    for line, record in enumerate(records[:n], 1):
        print(saved_header(record))
        if record.get("token_ids") is None:
            print("(saved without token_ids: the text as it is, trained spans not marked)")
        print(marked_text(saved_pieces(record, tokenizer, f"{path}, line {line}"), color))


def run_tokenizer(config_path: Path) -> Any:
    """The tokenizer of the model.name a run's config.json names; DataError when there is no
    config or no model.name in it."""
    from fnt.errors import DataError
    from fnt.model.tokenizer import load_tokenizer

    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"{config_path}: no such file, so no tokenizer to decode the samples"
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{config_path}: not valid JSON ({e})") from None
    name = (config.get("model") or {}).get("name") if isinstance(config, dict) else None
    if not name:
        raise DataError(f"{config_path}: no model.name, so no tokenizer to decode the samples")
    return load_tokenizer(name)
