"""A training mode written for tests/fnt/test_modes.py, to show what adding one takes: its config
class, the builder of its handles, its preflight and the check of its own keys here, and one
entry in fnt.config.modes.MODES (its step and source are SFT's). Side effects: `check_toy_data`
records each config it checks in PREFLIGHTS; the rest is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dataclasses_json import dataclass_json

from fnt.config import Config, ConfigError, Mode
from fnt.data.synthetic import SyntheticData
from fnt.distributed.runtime import Runtime


@dataclass_json
@dataclass(frozen=True)
class ToyConfig(Config):
    """An SFT run on synthetic rows of another seed."""

    shift: int = 1
    """Added to seed for the synthetic rows."""


def check_toy(config: ToyConfig, dp: int) -> None:
    """ConfigError unless shift is at least 1."""
    if config.shift < 1:
        raise ConfigError(f"'shift' = {config.shift!r}: must be at least 1")


PREFLIGHTS: list[int] = []
"""The shift of each config `check_toy_data` saw."""


def check_toy_data(config: ToyConfig) -> None:
    PREFLIGHTS.append(config.shift)


def toy_handles(config: ToyConfig, runtime: Runtime, announce: bool = False) -> dict[str, Any]:
    data = SyntheticData(
        seed=config.seed + config.shift,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        micro_batch_size=config.micro_batch_size,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dims.dp,
    )
    return {"data": data}


TOY = Mode(
    config=ToyConfig,
    summary="SFT on synthetic rows of seed + shift",
    step="steps:sft_step",
    source="fnt.sources:sft_source",
    handles="tests.fnt.toy_mode:toy_handles",
    eval_data="fnt.evaluation.held_out:load_eval_data",
    preflight="tests.fnt.toy_mode:check_toy_data",
    check=check_toy,
)
"""Its entry, which the test puts in MODES as "toy"."""
