"""max_epochs: its resolution to steps (pure, planned as training plans them), the rule when
max_steps is given too, the runs it applies to, and that a resume keeps the recorded count."""

from __future__ import annotations

import pytest

from fnt.batch import DataPosition
from fnt.config import Config, ConfigError, DataSourceConfig, RLConfig, load_config
from fnt.config.validation import validate
from fnt.data.order import SampleOrder
from fnt.data.packing import plan_step, steps_for_epochs
from fnt.start import with_recorded_steps

ORDER = SampleOrder(source_sizes=(7, 5), weights=(1.0, 2.0), seed=3, shuffle=True)
LENGTHS = [3, 9, 4, 0, 7, 2, 5, 8, 1, 6, 3, 4]  # sample 3 is dropped


def positions(steps: int, seq_len: int, batch_size: int) -> list[int]:
    """Samples consumed from the start after each of `steps` steps."""
    out, position = [], DataPosition()
    for _ in range(steps):
        position = plan_step(
            ORDER, position, LENGTHS.__getitem__, seq_len=seq_len, batch_size=batch_size
        ).data_after
        out.append(position.epoch * ORDER.epoch_length + position.cursor)
    return out


@pytest.mark.parametrize("epochs", [1, 2, 3, 0.5, 1.25])
@pytest.mark.parametrize(("seq_len", "batch_size"), [(10, 1), (12, 2), (9, 3)])
def test_the_resolved_step_is_the_first_to_reach_the_epochs(epochs, seq_len, batch_size):
    steps = steps_for_epochs(
        ORDER, LENGTHS.__getitem__, epochs, seq_len=seq_len, batch_size=batch_size
    )
    consumed = positions(steps, seq_len, batch_size)
    target = epochs * ORDER.epoch_length
    assert consumed[-1] >= target
    assert steps == 1 or consumed[-2] < target


def test_one_sample_per_row_takes_epoch_length_over_batch_size_steps():
    full = [10] * ORDER.epoch_length
    assert steps_for_epochs(ORDER, full.__getitem__, 2, seq_len=10, batch_size=3) == 8


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_max_steps_and_max_epochs_in_one_place_is_one_clear_error(tmp_path):
    with pytest.raises(
        ConfigError, match=r"'max_steps' = 5 and 'max_epochs' = 2.0 \(command line\)"
    ):
        load_config(["--max-steps", "5", "--max-epochs", "2"])
    toml = write_toml(tmp_path, "max_steps = 5\nmax_epochs = 2\n")
    with pytest.raises(ConfigError, match="both set the run's length: give one"):
        load_config(["--config", toml])


def test_the_command_line_wins_over_the_file_for_the_runs_length(tmp_path):
    config, _ = load_config(
        ["--config", write_toml(tmp_path, "max_steps = 5\n"), "--max-epochs", "2"]
    )
    assert config.max_epochs == 2.0
    config, _ = load_config(
        ["--config", write_toml(tmp_path, "max_epochs = 2\n"), "--max-steps", "7"]
    )
    assert (config.max_steps, config.max_epochs) == (7, 0.0)


SOURCES = (DataSourceConfig(path="train.jsonl"),)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Config(max_epochs=-1.0), "must be a finite number > 0"),
        (Config(max_epochs=float("inf")), "must be a finite number > 0"),
        (Config(max_epochs=1.0), "data.kind = 'synthetic' is endless"),
        (RLConfig(max_epochs=1.0), "an RL run draws prompts endlessly"),
    ],
)
def test_max_epochs_is_refused_where_it_means_nothing(config, message):
    with pytest.raises(ConfigError, match=message):
        validate(config, 1)


def test_a_resume_keeps_the_recorded_steps_while_max_epochs_is_unchanged():
    config = Config(max_epochs=2.0, max_steps=10)
    assert with_recorded_steps(config, {"max_epochs": 2.0, "max_steps": 37}).max_steps == 37
    assert with_recorded_steps(config, {"max_epochs": 3.0, "max_steps": 37}).max_steps == 10
    assert with_recorded_steps(config, None).max_steps == 10
    assert (
        with_recorded_steps(Config(max_steps=10), {"max_epochs": 0.0, "max_steps": 37}).max_steps
        == 10
    )
