"""`fnt show-rollouts`: a step's trajectories as the in-process engine samples them, the sampled
tokens told apart from the context (prompt, the environment's feedback, template text)."""

from __future__ import annotations

import re

from fnt.apps.show_rollouts import trajectory_header
from fnt.rollout.environments.feedback import DEFAULT_HINT
from fnt.rollout.pack import RolloutSample
from tests.e2e.helpers import config_args, read_metrics, run_cli

HEADER = re.compile(
    r"^== prompt line (\d+): reward (\S+), advantage \S+, (\d+) turns?, .*; (\d+) tokens "
    r"\((\d+) sampled, (\d+) context\)$"
)


def test_show_rollouts_prints_a_steps_episodes_with_sampled_tokens_marked(policy_dir, tmp_path):
    extra = (
        "--rollout.environment",
        "tests.fnt.rollout.multi_turn_env:feedback",
        "--rollout.max-turns",
        "3",
        "--batch-size",
        "8",  # a row per episode: episodes are up to seq_len long
        "--runtime.num-threads",
        "1",
    )
    args = config_args("examples/debug/rl.toml", policy_dir, tmp_path / "run", *extra)
    shown = run_cli("show-rollouts", *args, "--step", "1", "--n", "8", "--color", "never").stdout
    headers = [HEADER.match(line) for line in shown.splitlines() if line.startswith("== ")]
    assert len(headers) == 8 and all(headers), shown
    # The texts: context as it is, sampled tokens between [[ and ]]; the hint is context.
    texts = re.split(r"^== .*$\n", shown, flags=re.M)[1:]
    multi = [t for h, t in zip(headers, texts) if int(h.group(3)) > 1]
    assert multi, shown
    for text in multi:
        context = re.sub(r"\[\[.*?\]\]", "", text, flags=re.S)
        assert DEFAULT_HINT in context
        assert DEFAULT_HINT not in "".join(re.findall(r"\[\[(.*?)\]\]", text, flags=re.S))
    for header in headers:
        total, sampled, context = (int(header.group(i)) for i in (4, 5, 6))
        assert sampled >= 1 and total == sampled + context

    # Exactly what step 1 of a run from this model samples: its row's episodes, turns, tokens.
    run_cli("rl", *args, "--max-steps", "1")
    (row,) = read_metrics(tmp_path / "run")
    assert row["rollout/episodes"] == len(headers)
    assert row["rollout/turns/mean"] == sum(int(h.group(3)) for h in headers) / len(headers)
    assert row["rollout/sampled_tokens"] == sum(int(h.group(5)) for h in headers)
    assert row["rollout/context_tokens"] == sum(int(h.group(6)) for h in headers)
    rewards = [float(h.group(2)) for h in headers]  # printed to 3 significant digits
    assert abs(sum(rewards) / len(rewards) - row["reward/mean"]) < 5e-3


def test_a_trajectory_header_names_its_episode_facts():
    sample = RolloutSample(
        token_ids=(1, 2, 3, 4, 5),
        sampled=(False, True, False, True, True),
        logprobs=(0.0, -0.5, 0.0, -0.1, -0.2),
        reward=0.5,
        advantage=-1.25,
        turns=2,
        tool_calls=3,
        tool_errors=1,
        truncated=True,
        named_rewards=(("final", 0.5), ("first", 0.0)),
    )
    assert trajectory_header("prompt line 4", sample) == (
        "== prompt line 4: reward 0.5, advantage -1.25, 2 turns, 3 tool calls (1 failed), "
        "truncated, rewards: final 0.5, first 0; 5 tokens (3 sampled, 2 context)"
    )
