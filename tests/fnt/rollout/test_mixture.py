"""Environment mixtures (rollout.environments): prompts drawn by weight from each member's
sources, deterministically; each prompt started, answered and scored by its own member; metrics
and saved samples per member; the config's errors."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch

from fnt.batch import DataPosition
from fnt.config import ConfigError, validate_rollout
from fnt.config.schema import MixtureEntryConfig, RolloutConfig
from fnt.rollout import InProcessEngine
from fnt.rollout.environments import PromptSource, Start, environment_of
from fnt.rollout.environments.mixture import MixtureEnvironment, member_name, tagged
from fnt.rollout.prompts import prompt_order, step_prompts
from fnt.rollout.saved_samples import sample_record

from .conftest import rl_config, rl_state


class Own:
    """Makes its own prompts from two sources (weights 1 and 3); scores 1.0 and a named 0.5.
    Starts only its own records, so a prompt given to the wrong member fails loudly."""

    reward_weights = {"style": 0.0}

    def prompt_sources(self, split):
        if split != "train":
            return ()
        few = tuple({"own": f"count {i}"} for i in range(3))
        many = tuple({"own": f"spell {i}"} for i in range(5))
        return (PromptSource("few", few, 1.0), PromptSource("many", many, 3.0))

    def start(self, record):
        return Start(({"role": "user", "content": record["own"]},))

    def respond(self, record, messages):
        return None

    def score(self, record, messages):
        assert "own" in record
        return {"correct": 1.0, "style": 0.5}


class FromFile:
    """Takes its prompts from its entry's JSONL file; scores 2.0 per episode."""

    def start(self, record):
        return Start(({"role": "user", "content": record["prompt"]},))

    def respond(self, record, messages):
        return None

    def score(self, record, messages):
        assert "prompt" in record
        return 2.0


def own(rollout):
    return Own()


def from_file(rollout):
    return FromFile()


def entries(prompts_file, own_weight=2.0, file_weight=1.0):
    return (
        MixtureEntryConfig(
            name="own", environment="tests.fnt.rollout.test_mixture:own", weight=own_weight
        ),
        MixtureEntryConfig(
            name="file",
            environment="tests.fnt.rollout.test_mixture:from_file",
            prompts=str(prompts_file),
            weight=file_weight,
        ),
    )


def mixture_rollout(prompts_file, **settings) -> RolloutConfig:
    return RolloutConfig(environments=entries(prompts_file), **settings)


def test_sources_weigh_entry_weight_times_the_members_own_share(prompts_file):
    mixture, _ = environment_of(mixture_rollout(prompts_file))
    sources = mixture.prompt_sources("train")
    assert [s.name for s in sources] == ["own/few", "own/many", "file/prompts"]
    assert [s.weight for s in sources] == [2.0 * 0.25, 2.0 * 0.75, 1.0]
    file_records = [json.loads(line) for line in open(prompts_file) if line.strip()]
    assert sources[2].records == tuple(tagged("file", r) for r in file_records)
    assert all(member_name(r) == "own" for r in sources[0].records + sources[1].records)
    assert mixture.prompt_sources("val") == ()


def test_prompts_are_drawn_in_proportion_to_weight_and_deterministically(prompts_file):
    mixture, _ = environment_of(mixture_rollout(prompts_file))
    sources = mixture.prompt_sources("train")
    sizes = [len(s.records) for s in sources]
    owners = [member_name(r) for s in sources for r in s.records]
    order = prompt_order(sum(sizes), 3, sizes, [s.weight for s in sources])
    ids, after = step_prompts(order, DataPosition(0, 0), 3000)
    counts = collections.Counter(owners[i] for i in ids)
    assert abs(counts["own"] / 3000 - 2 / 3) < 0.03, counts
    # The same seed and position give the same draws; a resumed order continues exactly.
    again = prompt_order(sum(sizes), 3, sizes, [s.weight for s in sources])
    assert step_prompts(again, DataPosition(0, 0), 3000) == (ids, after)
    first, middle = step_prompts(order, DataPosition(0, 0), 1000)
    rest, end = step_prompts(again, middle, 2000)
    assert first + rest == ids and end == after


def test_each_record_goes_to_its_own_member_and_named_rewards_are_renamed(prompts_file):
    mixture, _ = environment_of(mixture_rollout(prompts_file))
    assert isinstance(mixture, MixtureEnvironment)
    own_record, file_record = tagged("own", {"own": "x"}), tagged("file", {"prompt": "y"})
    assert mixture.start(own_record).messages[0]["content"] == "x"
    assert mixture.start(file_record).messages[0]["content"] == "y"
    assert mixture.score(own_record, []) == {"own/correct": 1.0, "own/style": 0.5}
    assert mixture.score(file_record, []) == 2.0
    assert mixture.reward_weights == {"own/style": 0.0}
    assert not hasattr(mixture, "score_turns")  # Own and FromFile do not score turns


def test_turn_credit_needs_every_member_to_score_turns(prompts_file):
    with pytest.raises(ConfigError, match=r"\['own', 'file'\].*do not score turns"):
        environment_of(mixture_rollout(prompts_file, credit="turn"))


@pytest.mark.parametrize(
    "beside, message",
    [
        (dict(environment="x:y"), r"'rollout.environment' = 'x:y': rollout.environments is set"),
        (dict(prompts="p.jsonl"), r"'rollout.prompts' = 'p.jsonl': rollout.environments is set"),
        (dict(environment_args="{}"), r"'rollout.environment_args' = '{}': rollout.environments"),
    ],
)
def test_a_mixture_beside_the_single_environment_keys_is_refused(prompts_file, beside, message):
    with pytest.raises(ConfigError, match=message):
        validate_rollout(mixture_rollout(prompts_file, **beside), dp_size=1)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(name="own"), r"'rollout.environments' names 'own' twice"),
        (dict(name="a/b"), r"'rollout.environments\[1\].name' = 'a/b'"),
        (dict(name=""), r"'rollout.environments\[1\].name' = ''"),
        (dict(weight=0.0), r"'rollout.environments\[1\].weight' = 0.0: must be a finite"),
        (dict(weight=float("nan")), r"'rollout.environments\[1\].weight' = nan"),
        (dict(environment=""), r"'rollout.environments\[1\].environment' is empty"),
        (dict(environment="nocolon"), r"'rollout.environments\[1\].environment' = 'nocolon'"),
        (dict(environment_args="{}"), r"'rollout.environments\[1\].environment_args'"),
        (dict(environment="reasoning_gym:leg_counting"), r"makes its own prompts"),
    ],
)
def test_a_bad_entry_is_one_clear_config_error(prompts_file, change, message):
    own_entry, file_entry = entries(prompts_file)
    rollout = RolloutConfig(environments=(own_entry, dataclasses.replace(file_entry, **change)))
    with pytest.raises(ConfigError, match=message):
        validate_rollout(rollout, dp_size=1)


def test_a_factory_without_prompts_must_make_its_own(prompts_file):
    own_entry, file_entry = entries(prompts_file)
    rollout = RolloutConfig(environments=(own_entry, dataclasses.replace(file_entry, prompts="")))
    mixture, _ = environment_of(rollout)
    with pytest.raises(ConfigError, match=r"entry 'file': its environment makes no prompts"):
        mixture.prompt_sources("train")


def test_an_engine_that_runs_no_episodes_refuses_a_mixture(policy_dir, prompts_file):
    from fnt.config.modes import check_rl

    config = rl_config(policy_dir, "", reward="", environments=entries(prompts_file))
    check_rl(config, dp=1)  # the in-process engine runs the members' episodes
    external = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, engine="external")
    )
    with pytest.raises(ConfigError, match=r"'rollout.environments' = .*the external engine's"):
        check_rl(external, dp=1)


def test_a_valid_mixture_passes_validation(prompts_file):
    validate_rollout(mixture_rollout(prompts_file), dp_size=1)


def test_the_engine_runs_and_scores_each_prompt_by_its_member(policy_dir, prompts_file):
    config = rl_config(policy_dir, "", reward="", environments=entries(prompts_file))
    config = dataclasses.replace(config, batch_size=16)
    state = rl_state(config)
    engine = state.handles.rollouts
    assert isinstance(engine, InProcessEngine)
    batch = engine.rollout(state)
    metrics = batch.metrics
    own_n, file_n = metrics["rollout/own/episodes"], metrics["rollout/file/episodes"]
    assert own_n + file_n == metrics["rollout/episodes"] == 16
    assert own_n > 0 and file_n > 0  # this seed's first step draws from both
    # Own scores 1.0 + 0.0 * 0.5 (style weighs 0), FromFile 2.0: each prompt by its own member.
    assert metrics["rollout/own/reward"] == 1.0
    assert metrics["rollout/file/reward"] == 2.0
    expected_mean = (1.0 * own_n + 2.0 * file_n) / 16
    assert metrics["reward/mean"] == pytest.approx(expected_mean)
    again = engine.rollout(state)  # the same state draws and samples the same episodes
    assert again.metrics["rollout/own/episodes"] == own_n
    for x, y in zip(batch.micro_batches, again.micro_batches):
        assert torch.equal(x.rows.input_ids, y.rows.input_ids)


def test_a_saved_sample_names_its_member_and_a_single_environments_does_not(tokenizer):
    from fnt.rollout.pack import RolloutSample

    sample = RolloutSample(
        token_ids=(1, 2, 3),
        sampled=(False, True, True),
        logprobs=(0.0, -1.0, -1.0),
        reward=1.0,
        advantage=0.0,
    )
    assert "environment" not in sample_record(sample, tokenizer)
    named = sample_record(dataclasses.replace(sample, environment="own"), tokenizer)
    assert named["environment"] == "own"


def test_entries_come_from_toml_tables_and_from_the_command_line(tmp_path):
    from fnt.config import RLConfig
    from fnt.config.loading import load_config

    path = tmp_path / "mix.toml"
    path.write_text(
        '[[rollout.environments]]\nname = "a"\nenvironment = "m:f"\nprompts = "a.jsonl"\n'
        '[[rollout.environments]]\nname = "b"\nenvironment = "reasoning_gym:gcd"\nweight = 3\n'
    )
    config, _ = load_config(["--config", str(path)], RLConfig)
    assert config.rollout.environments == (
        MixtureEntryConfig(name="a", environment="m:f", prompts="a.jsonl"),
        MixtureEntryConfig(name="b", environment="reasoning_gym:gcd", weight=3.0),
    )
    override = json.dumps([{"name": "c", "environment": "m:g", "weight": 0.5}])
    config, _ = load_config(["--config", str(path), "--rollout.environments", override], RLConfig)
    assert config.rollout.environments == (
        MixtureEntryConfig(name="c", environment="m:g", weight=0.5),
    )


def test_val_prompts_beside_a_mixture_is_one_clear_config_error(policy_dir, prompts_file):
    from fnt.config.schema import ValConfig
    from fnt.config.validation import validate_val

    config = rl_config(policy_dir, "", reward="", environments=entries(prompts_file))
    validate_val(config)  # no val section: nothing to check
    config = dataclasses.replace(config, val=ValConfig(prompts=str(prompts_file), interval=1))
    with pytest.raises(ConfigError, match=r"'val.prompts' = .*names no member to run it"):
        validate_val(config)


def mixture_batch(model_dir: str, prompts: str, output_dir: str):
    """The first batch of a mixture run (8 prompts x 4), and the runtime that made it."""
    from fnt import rl_source

    config = rl_config(model_dir, "", reward="", environments=entries(prompts))
    config = dataclasses.replace(config, batch_size=16, output_dir=output_dir)
    config = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, prompts_per_step=8)
    )
    state = rl_state(config)
    return state.handles.runtime, rl_source(state)


def save_mixture_batch(model_dir: str, prompts: str, out: str) -> None:
    """A two-rank job: each rank's first mixture batch in OUT/rank{rank}.pt."""
    from fnt.distributed.runtime import teardown_trainer

    runtime, batch = mixture_batch(model_dir, prompts, f"{out}/run")
    torch.save(batch.metrics, f"{out}/rank{runtime.rank}.pt")
    teardown_trainer(runtime)


def mixture_job(fixture, out):
    inputs = [str(fixture("policy_dir")), str(fixture("prompts_file"))]
    return {
        "call": "tests.fnt.rollout.test_mixture:save_mixture_batch",
        "args": [*inputs, str(out)],
    }


@pytest.mark.two_ranks(job=mixture_job)
def test_two_ranks_log_each_environment_as_one_process(
    policy_dir, prompts_file, two_rank_runs, tmp_path
):
    out = two_rank_runs(mixture_job)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _, one = mixture_batch(str(policy_dir), str(prompts_file), str(tmp_path))
    assert one.metrics["rollout/own/episodes"] > 0 and one.metrics["rollout/file/episodes"] > 0
    for key in ("rollout/own/episodes", "rollout/file/episodes", "reward/mean"):
        assert ranks[0][key] == ranks[1][key] == pytest.approx(one.metrics[key]), key
    assert ranks[0]["rollout/own/reward"] == ranks[1]["rollout/own/reward"] == 1.0
    assert ranks[0]["rollout/file/reward"] == ranks[1]["rollout/file/reward"] == 2.0
