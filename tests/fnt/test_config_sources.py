"""Config rules of data sources (files and datasets, columns) and of the val section."""

from __future__ import annotations

import pytest

from fnt.config import (
    Config,
    ConfigError,
    DataConfig,
    DataSourceConfig,
    RLConfig,
    RolloutConfig,
    ValConfig,
    load_config,
    source_name,
    validate,
)


def with_sources(*sources: DataSourceConfig) -> Config:
    return Config(data=DataConfig(kind="sources", sources=sources))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (DataSourceConfig(), r"'data.sources\[0\].path' is empty.*'data.sources\[0\].dataset'"),
        (DataSourceConfig(path="a.jsonl", dataset="org/x"), "a source reads one of them"),
        (DataSourceConfig(path="a.jsonl", subset="s"), "only a dataset has subsets"),
        (DataSourceConfig(path="a.jsonl", completion_column=""), "name both columns, or neither"),
        (
            DataSourceConfig(path="a", messages_column="", prompt_column="", completion_column=""),
            "are all empty",
        ),
    ],
)
def test_a_source_must_name_one_place_to_read_and_columns_to_read(source, message):
    with pytest.raises(ConfigError, match=message):
        validate(with_sources(source), 1)


def test_dataset_sources_are_named_after_the_dataset_and_must_differ():
    a = DataSourceConfig(dataset="org/chat", split="train")
    b = DataSourceConfig(dataset="other/chat", split="train")
    assert source_name(a) == "chat"
    assert source_name(DataSourceConfig(path="data/dir/")) == "dir"
    assert source_name(DataSourceConfig(path="snap/data/train-*.parquet")) == "train"
    assert source_name(DataSourceConfig(path="snap/data/*.parquet")) == "data"
    with pytest.raises(ConfigError, match=r"source names must differ.*\['chat', 'chat'\]"):
        validate(with_sources(a, b), 1)
    validate(with_sources(a, DataSourceConfig(dataset="other/chat", name="chat2")), 1)


def test_a_dataset_source_comes_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        "[data]\nkind = 'jsonl'\n"
        "sources = [{dataset = 'org/chat', subset = 'en', split = 'test', "
        "messages_column = 'conversation'}]\n"
        "[val]\ninterval = 5\nsources = [{path = 'val.parquet'}]\n"
    )
    config, _ = load_config(["--config", str(path)])
    (source,) = config.data.sources
    assert (source.dataset, source.subset, source.split) == ("org/chat", "en", "test")
    assert source.messages_column == "conversation"
    assert config.val.interval == 5 and config.val.sources[0].path == "val.parquet"
    validate(config, 1)


VAL = (DataSourceConfig(path="val.jsonl"),)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Config(val=ValConfig(interval=-1, sources=VAL)), "must be >= 0"),
        (Config(val=ValConfig(sources=VAL)), "would never be evaluated"),
        (Config(val=ValConfig(interval=3)), "validation needs data"),
        (Config(val=ValConfig(eval_on_start=True)), "validation needs data"),
        (Config(val=ValConfig(interval=3, sources=(DataSourceConfig(),))), r"'val.sources\[0\]"),
        (Config(val=ValConfig(interval=3, prompts="p.jsonl")), "need an RL run"),
        (Config(val=ValConfig(interval=3, sources=VAL, samples=-1)), "'val.samples' = -1"),
        (
            Config(val=ValConfig(interval=3, sources=VAL, samples=4)),
            "'val.samples' = 4: sampled episodes are of held-out prompts",
        ),
        (
            RLConfig(
                val=ValConfig(interval=3, prompts="p.jsonl"),
                rollout=RolloutConfig(engine="external"),
            ),
            "in_process rollout engine",
        ),
    ],
)
def test_validation_must_evaluate_something_sometime(config, message):
    with pytest.raises(ConfigError, match=message):
        validate(config, 1)


def test_valid_val_sections():
    validate(Config(val=ValConfig(interval=2, sources=VAL)), 1)
    validate(Config(val=ValConfig(eval_on_start=True, sources=VAL)), 1)
    rollout = RolloutConfig(prompts="p.jsonl", reward="exact_match")
    validate(RLConfig(rollout=rollout, val=ValConfig(interval=1, prompts="v.jsonl")), 1)
