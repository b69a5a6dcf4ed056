"""RL entry point: `python scripts/rl.py --config FILE.toml [--key=value]...`

Same driver, config system, checkpoints and metrics as SFT; rollouts come from the in-process
engine or, with `--rollout.engine external`, from an orchestrator writing {output_dir}/rollouts/.
Exits 2 on a bad config before any model is built.
"""

from __future__ import annotations

import sys

from fnt.cli import config_from_argv, exit_on_config_error
from fnt.config import ConfigError, RLConfig


def main(argv: list[str]) -> None:
    config = config_from_argv(argv, RLConfig)
    from fnt.loop import run
    from fnt.rollout import rl_batches
    from fnt.rollout.external import external_batches, publish_weights_
    from steps.rl import rl_step

    try:
        if config.rollout.engine == "external":
            run(config, rl_step, external_batches, after_step=publish_weights_)
        else:
            run(config, rl_step, rl_batches)
    except ConfigError as exc:
        exit_on_config_error(exc)


if __name__ == "__main__":
    main(sys.argv[1:])
