"""Supervised fine-tuning entry point: `python scripts/sft.py --config FILE.toml [--key=value]...`

Also runs under `torchrun --nproc-per-node N`. Exits 2 on a bad config before any model is built.
"""

from __future__ import annotations

import sys

from fnt.cli import config_from_argv, exit_on_config_error
from fnt.config import ConfigError


def main(argv: list[str]) -> None:
    config = config_from_argv(argv)
    from fnt.loop import run
    from fnt.sources import sft_batches
    from steps.sft import sft_step

    try:
        run(config, sft_step, sft_batches)
    except ConfigError as exc:
        exit_on_config_error(exc)


if __name__ == "__main__":
    main(sys.argv[1:])
