"""An SFT driver written with the seed's helpers, the way its loops call them: it writes the
rows `fnt sft` writes for the same config. Run it like the command, also under torchrun:

    python examples/seed_loops/sft_loop.py --config examples/debug/sft.toml --max-steps 5
"""

import sys
import time

from fnt import (
    init_state,
    log_step_metrics,
    resolve_resume_step,
    restore_,
    save_state_,
    save_trace,
    setup_trainer,
    sft_source,
    start_trace,
    teardown_trainer,
)
from fnt.apps.cli import parse_config
from fnt.obs.monitors import open_monitors
from fnt.store.rundir import ckpt_root, step_dir
from steps import sft_step


def main(argv: list[str]) -> None:
    config, _ = parse_config(argv)
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    root = ckpt_root(config.output_dir)
    resume_step = resolve_resume_step(config.resume, root)
    if resume_step:
        state = restore_(state, step_dir(root, resume_step))
    monitors = open_monitors(config, state.progress.step) if runtime.is_main else None
    prof = start_trace(config.trace_path)
    while state.progress.step < config.max_steps:
        started, tokens_before = time.perf_counter(), state.progress.total_tokens
        state, metrics = sft_step(state, sft_source(state))
        log_step_metrics(
            state.progress.step,
            metrics,
            runtime=runtime,
            step_time=time.perf_counter() - started,
            num_tokens=state.progress.total_tokens - tokens_before,
            progress=state.progress,
            ckpt_dir=root,
            timing={"time/save_ckpt": 0.0},
            monitors=monitors,
        )
    save_state_(state)
    save_trace(prof, config.trace_path)
    if monitors is not None:
        monitors.close()
    teardown_trainer(runtime)


if __name__ == "__main__":
    main(sys.argv[1:])
