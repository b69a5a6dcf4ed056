"""The `fnt` command line: `fnt COMMAND ...`, or `python -m fnt COMMAND ...`. Side effects:
those of the command it runs (each command's module names its own: a training command takes the
output_dir's lock on rank 0 and runs `fnt.run`; `export` writes --out); it prints the usage, the
version and export's summary, and exits with the command's status (2 on bad input).

The second form is the one torchrun launches: `torchrun --nproc-per-node 2 -m fnt sft ...`.

Design rule: the fnt library never imports the `steps` package, where the step functions live,
because steps are handed to the driver (`run(config, step, source)`), not built into it. This
module is the command-line application, run only as a program and never imported by the
library, and it is the one place that imports steps: lazily, inside the training commands, so
that `fnt --help`, a bad command line and the other commands need neither steps nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fnt.apps.cli import exit_on_bad_input, parse_config
from fnt.apps.preflight import check_inputs
from fnt.config import Config, DPOConfig, RLConfig
from fnt.config.schema import DTYPE_NAMES
from fnt.errors import ConfigError
from fnt.store.rundir import rank0_run_lock

USAGE = """\
usage: fnt COMMAND [ARGS]...   (or: python -m fnt COMMAND [ARGS]...)

commands:
  sft              supervised fine-tuning: fnt sft --config FILE.toml [--key=value]...
  rl               reinforcement learning: fnt rl --config FILE.toml [--key=value]...
                   (fnt rl --list-environments: what rollout.environment can name)
  dpo              preference optimization on pairs: fnt dpo --config FILE.toml [--key=value]...
  vllm-serve       start the vLLM server of an RL run: fnt vllm-serve --config FILE.toml
  export           write a checkpoint as a Hugging Face model directory
  generate         answer prompts with a checkpoint or model, chat template applied:
                   fnt generate --checkpoint DIR (--prompt TEXT | --prompts FILE.jsonl)
  make-tiny-model  write a tiny Hugging Face model for tests and demos
  show-data        print SFT samples, trained tokens marked: fnt show-data --config FILE [--n 3]
  show-rollouts    print an RL step's trajectories, sampled tokens marked:
                   fnt show-rollouts --config FILE [--step N] [--n 3]
  inspect          summarize a run directory: fnt inspect RUN [--json] [--diff OTHER_RUN]
  plot             plot runs' metrics as one PNG: fnt plot RUN [RUN...] [--out FILE.png]

`fnt sft --help` or `-h` (and rl, dpo) lists the config keys; every other command takes -h too.
`fnt --version` prints the version.
Under torchrun: torchrun --nproc-per-node N -m fnt sft --config FILE.toml"""


def version() -> str:
    """fnt's installed version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("fnt")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def train_sft(config: Config) -> None:
    from fnt.loop import run
    from fnt.sources import sft_source
    from steps import sft_step

    run(config, sft_step, sft_source)


def train_rl(config: RLConfig) -> None:
    from fnt.build import policy_publisher
    from fnt.loop import run
    from fnt.sources import rl_source
    from steps import rl_step

    run(config, rl_step, rl_source, on_state=policy_publisher(config))


def train_dpo(config: DPOConfig) -> None:
    from fnt.loop import run
    from fnt.sources import pair_source
    from steps import dpo_step

    run(config, dpo_step, pair_source)


def train(argv: list[str], cls: type, train_config) -> None:
    """Parse and validate the command line, check the inputs, take the output_dir's lock (rank
    0), train. The checks only read, and come before the lock, which creates output_dir: a bad
    input leaves the disk as it was. A second run on a busy directory is refused there, after
    the checks, still before any model is built."""
    config, model_name_source = parse_config(argv, cls)
    check_inputs(config, model_name_source)
    with rank0_run_lock(config.output_dir):
        train_config(config)


def sft(argv: list[str]) -> None:
    """`fnt sft --config FILE.toml [--key=value]...`; a bad config exits 2 before any model."""
    train(argv, Config, train_sft)


def rl(argv: list[str]) -> None:
    """`fnt rl --config FILE.toml [--key=value]...`: rollouts from the in-process engine, from
    vLLM servers (`--rollout.engine vllm`) or, with `--rollout.engine external`, from an
    orchestrator writing {output_dir}/rollouts/. `fnt rl --list-environments` lists what
    rollout.environment can name."""
    if "--list-environments" in argv:
        if any(arg in ("-h", "--help") for arg in argv):
            print("usage: fnt rl --list-environments\n\nList what rollout.environment can name.")
            sys.exit(0)
        if len(argv) > 1:
            raise ConfigError(
                "--list-environments (command line) takes no other options: "
                "fnt rl --list-environments"
            )
        from fnt.apps.environments import main

        main()
        return
    train(argv, RLConfig, train_rl)


def dpo(argv: list[str]) -> None:
    """`fnt dpo --config FILE.toml [--key=value]...`: preference optimization on the pairs of
    data.sources (steps.dpo_step); a bad config exits 2 before any model."""
    train(argv, DPOConfig, train_dpo)


def export(argv: list[str]) -> None:
    """`fnt export --checkpoint RUN/checkpoints/step_N --out HF_DIR [--dtype bfloat16] [--merge]
    [--force]`: fnt.apps.export.export_hf_, whose checks (fnt.apps.preflight.check_export) and
    creation of the directory the export is written into (fnt.store.transaction.staged_dir_)
    come before torch is imported, so `--help`, a bad argument, a bad checkpoint or a bad --out
    answer at once."""
    parser = argparse.ArgumentParser(
        prog="fnt export", description="Export a checkpoint as a Hugging Face model directory."
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="a complete step_N directory"
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory to write: new, empty, or an earlier export (replaced)",
    )
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="cast the weights")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write the full model with the adapters merged in, not the "
        "PEFT adapter directory",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace --out even when it holds other files (never a run directory)",
    )
    args = parser.parse_args(argv)
    from fnt.apps.export import export_hf_  # torch-free until the checks and --out are done

    export_hf_(args.checkpoint, args.out, args.dtype, merge=args.merge, force=args.force)
    print(
        json.dumps(
            {
                "checkpoint": str(args.checkpoint),
                "out": str(args.out),
                "dtype": args.dtype,
                "merge": args.merge,
            }
        )
    )


def vllm_serve(argv: list[str]) -> None:
    from fnt.apps.vllm_serve import main

    main(argv)


def generate(argv: list[str]) -> None:
    from fnt.apps.generate import main

    main(argv)


def make_tiny_model(argv: list[str]) -> None:
    from fnt.model.tiny_model import main  # torch only once --out is checked

    main(argv)


def show_data(argv: list[str]) -> None:
    from fnt.apps.show_data import main

    main(argv)


def show_rollouts(argv: list[str]) -> None:
    from fnt.apps.show_rollouts import main

    main(argv)


def inspect_run(argv: list[str]) -> None:
    from fnt.apps.inspect import main

    main(argv)


def plot(argv: list[str]) -> None:
    from fnt.apps.plot import main

    main(argv)


COMMANDS = {
    "sft": sft,
    "rl": rl,
    "dpo": dpo,
    "vllm-serve": vllm_serve,
    "export": export,
    "generate": generate,
    "make-tiny-model": make_tiny_model,
    "show-data": show_data,
    "show-rollouts": show_rollouts,
    "inspect": inspect_run,
    "plot": plot,
}


def main(argv: list[str] | None = None) -> None:
    """Run the command named by argv[0] (default: sys.argv[1:]); exit 2 on bad input.

    Output piped into a reader that stops early (`fnt sft --help | head`) ends quietly: what the
    reader did not take is not wanted, so the broken pipe is no error worth a traceback."""
    try:
        try:
            run_command(sys.argv[1:] if argv is None else argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        # Later writes (at exit) must not meet the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def run_command(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    if argv and argv[0] == "--version":
        print(f"fnt {version()}")
        sys.exit(0)
    if not argv or argv[0] not in COMMANDS:
        unknown = f"\nerror: unknown command {argv[0]!r}" if argv else ""
        print(USAGE + unknown, file=sys.stderr)
        sys.exit(2)
    with exit_on_bad_input():
        COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
