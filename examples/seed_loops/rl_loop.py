"""An RL driver written with the seed's helpers, the way its loops call them: it writes the
rows `fnt rl` writes for the same config. Run it like the command, also under torchrun:

    python examples/seed_loops/rl_loop.py --config examples/debug/rl.toml --max-steps 3
"""

import sys
import time

from fnt import (
    init_state,
    log_step_metrics,
    resolve_resume_step,
    restore_,
    rl_source,
    save_state_,
    save_trace,
    setup_trainer,
    start_trace,
    teardown_trainer,
)
from fnt.apps.cli import parse_config
from fnt.build import policy_publisher
from fnt.config import RLConfig
from fnt.obs.monitors import open_monitors
from fnt.store.rundir import ckpt_root, step_dir
from steps import rl_step


def main(argv: list[str]) -> None:
    config, _ = parse_config(argv, RLConfig)
    publish = policy_publisher(config)  # the external and vLLM engines sample what it publishes
    runtime = setup_trainer(config)
    state = init_state(config, runtime)
    root = ckpt_root(config.output_dir)
    resume_step = resolve_resume_step(config.resume, root)
    if resume_step:
        state = restore_(state, step_dir(root, resume_step))
    monitors = open_monitors(config, state.progress.step) if runtime.is_main else None
    prof = start_trace(config.trace_path)
    if publish is not None:
        publish(state)
    while state.progress.step < config.max_steps:
        started, tokens_before = time.perf_counter(), state.progress.total_tokens
        state, metrics = rl_step(state, rl_source(state))
        step_time, timing = time.perf_counter() - started, {"time/save_ckpt": 0.0}
        if publish is not None:
            publish(state)
            timing["time/after_step"] = time.perf_counter() - started - step_time
        log_step_metrics(
            state.progress.step,
            metrics,
            runtime=runtime,
            step_time=step_time,
            num_tokens=state.progress.total_tokens - tokens_before,
            progress=state.progress,
            ckpt_dir=root,
            timing=timing,
            monitors=monitors,
        )
    save_state_(state)
    save_trace(prof, config.trace_path)
    if monitors is not None:
        monitors.close()
    teardown_trainer(runtime)


if __name__ == "__main__":
    main(sys.argv[1:])
