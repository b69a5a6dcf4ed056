"""Benchmark fnt's RL step against a bare GRPO loop doing the same work, side by side in one run.

Side effects: writes the demo's base model and data under --work (unless --model and --prompts
name existing ones), loads two copies of the model, trains both for --steps steps, prints a
table and, as its last line, one JSON object.

Both sides get the reverse-text demo's model, prompts and step shape (examples/reverse_text/
rl.toml: 24 prompts x 8 samples, temperature 0.5, at most 12 new tokens, one torch thread) and
the same prompts at every step (fnt's prompt order):

    fnt   rl_source(state) (the in-process engine: sync the inference copy, generate, score,
          pack), then steps.rl_step (forward/backward over the packed rows, AdamW), and the
          driver's one host sync of the metrics (fnt.obs.metrics.to_floats)
    bare  HF `model.generate` on all 192 sequences at once with the KV cache (left padding,
          top_k 0 so it samples the full softmax like fnt), the same similarity reward, group
          advantages (mean-centred, divided by the group std), one forward/backward of the
          padded sequences with the REINFORCE surrogate -A * exp(logp - stopgrad(logp)) over the
          completion tokens, gradient clipping at optim.max_norm, torch AdamW

Times are the median over the steps after --warmup warm-up steps; the two sides alternate step
by step so that machine noise hits both alike. `--async-level K` runs fnt with
rollout.async_level = K (rollouts of the next step generated while this one trains).

`--engine vllm` compares fnt's two engines instead, on the same task and prompts: fnt with
rollout.engine = "vllm" (a vLLM server, started here with `fnt vllm-serve` unless --vllm-url
names one, reloads the policy each step publishes; publishing is part of its step time) against
fnt with the in-process engine. It reports seconds per step and generation tokens per second
(rollout/tokens_per_second: the step's completion tokens over the time spent producing them,
loading the weights into the server included).

`--multi-turn` times multi-turn episodes against single-turn ones with as many sampled tokens,
both with fnt's in-process engine, step by step in turn: 3-turn episodes of the reverse-text task
(examples/reverse_text/environments.py:three_turns: every answer but the third gets a hint, the
first half of the reversal) of 8 prompts x 8 samples, against single-turn episodes of as many
prompts x 8 samples as sample about as many tokens a step (sized from warm-up steps of both: an
answer after a hint is shorter than a first one). Both sides keep their starting policy
(optim.lr = 0: the update's work is all done, its step is zero): a learning policy drifts, its
answers growing until max_new_tokens cuts them, which ends an episode (3.0 turns fell to 1.0
within 14 steps), and the task would no longer be 3 turns. The demo's base model never stops (its
answers all run to max_new_tokens), so this case starts from the demo's SFT result, trained here
under --work first (about a minute) unless --model names a model that ends its turns. It reports
seconds per step (rollout, update), sampled and context tokens per step, and two rates of the
whole step: sampled tokens/s, and all tokens/s (sampled and context: every token the rollout
reads and the update trains); each ratio is single-turn over multi-turn (target: at most 1.3).
A 3-turn episode of this task carries 9 context tokens (prompt, hints, template text) per
sampled token against 4.9 for one turn. The numbers measured are in docs/performance.md
("Multi-turn RL").

The multi-turn episodes run under the default schedule (episodes that advance on their own);
the same episodes under rollout.lockstep = true (every turn a barrier over all episodes) are
timed in the same run as a third side (multi_turn_lockstep; lockstep_tok_s_ratio).

`--long-tail` times the two schedules of multi-turn episodes against each other, step by step in
turn (which side goes first alternates): rollout.lockstep = true against the default, episodes
that advance on their own, on the same seed, prompts and policy (the starting one, optim.lr = 0,
as --multi-turn, from the demo's SFT result). The environment (scripts/bench_rl_env.py) runs
each prompt's episodes for 1 to 8 turns, long-tailed (40% one turn, 3% eight; 2.6 on average),
and each of its calls takes --latency-ms (20; one call in 8 five times as long), as a tool or a
sandbox would; 16 prompts x 4 episodes a step. It reports seconds per step (rollout, update),
per sampled token, the environment's latency a step (its calls' sleeps, summed: what a schedule
that makes them one after another waits), whether both sides sampled the same tokens and
rewards, and each ratio lockstep over independent (target: at least 1.5).

`--compile` times fnt with model.compile (every decoder layer compiled, fnt.model.compile, the
in-process engine's copy included: it decodes compiled) against fnt eager, step by step in turn:
rollout and update seconds separately and generation tokens/s (rollout/tokens_per_second;
medians after --warmup, compiling left out of the seconds), the seconds and graphs the
compiled side spent compiling (all of them, warm-up included) and the break-even step count
(compile seconds over the per-step saving; null when compiled steps are not faster).

    python scripts/bench_rl.py [--steps 12] [--warmup 2] [--model DIR --prompts FILE] [--work DIR]
                               [--engine vllm [--vllm-url URL | --vllm PROGRAM]] [--multi-turn]
                               [--long-tail [--latency-ms 20]] [--compile]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "reverse_text"


def demo_inputs(work: Path) -> tuple[Path, Path]:
    """The demo's base model and RL prompts, written under `work` as `make demo` writes them."""
    sys.path.insert(0, str(DEMO))
    from demo import TINY_MODEL

    model, data = work / "reverse-model", work / "reverse-data"
    if not (model / "config.json").is_file():
        subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(model)]
            + TINY_MODEL,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    if not (data / "rl.jsonl").is_file():
        subprocess.run(
            [sys.executable, str(DEMO / "make_data.py"), "--out", str(data)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return model, data / "rl.jsonl"


def task_args(model: Path, prompts: Path) -> list[str]:
    """The config arguments of the task both sides run (the demo's RL stage)."""
    return [
        "--config",
        str(DEMO / "rl.toml"),
        f"--model.name={model}",
        f"--rollout.prompts={prompts}",
    ]


# The vLLM engine's settings for a local CPU server (as the demo's): a small KV cache is plenty.
VLLM_SETTINGS = ["--rollout.vllm.kv_cache_gb=1", "--rollout.vllm.gpu_memory_utilization=0.3"]


def fnt_config(task: list[str], out: Path, async_level: int, *extra: str):
    from fnt.config import RLConfig, load_config

    argv = [*task, f"--output_dir={out}", f"--rollout.async_level={async_level}", *extra]
    config, _ = load_config(argv, RLConfig)
    return config


class Bare:
    """The bare GRPO loop on its own copy of the model."""

    def __init__(self, config, model_dir: Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        from fnt.model.tokenizer import load_tokenizer
        from fnt.rollout.rewards import reward_function

        self.config, self.rollout, self.device = config, config.rollout, device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.to(device).train()
        self.tokenizer = load_tokenizer(str(model_dir))
        self.reward_fn = reward_function(self.rollout.reward)
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )

    def step(self, prompts, seed: int) -> tuple[float, float, float]:
        """One GRPO step on `prompts`; (rollout seconds, update seconds, mean reward)."""
        rollout, tok = self.rollout, self.tokenizer
        group = rollout.group_size
        started = time.perf_counter()
        width = max(len(p.token_ids) for p in prompts)
        pad = tok.pad_token_id
        ids = torch.tensor(
            [[pad] * (width - len(p.token_ids)) + list(p.token_ids) for p in prompts],
            device=self.device,
        )
        attention = torch.tensor(
            [[0] * (width - len(p.token_ids)) + [1] * len(p.token_ids) for p in prompts],
            device=self.device,
        )
        torch.manual_seed(seed)
        sequences = self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=True,
            temperature=rollout.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=rollout.max_new_tokens,
            num_return_sequences=group,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )
        completions = sequences[:, width:]
        # Tokens after the first eos are generate's padding: not part of the completion.
        after_eos = (completions == tok.eos_token_id).int().cumsum(-1) - (
            completions == tok.eos_token_id
        ).int()
        completion_mask = after_eos == 0
        texts = tok.batch_decode(
            completions.masked_fill(~completion_mask, pad), skip_special_tokens=True
        )
        records = [p.record for p in prompts for _ in range(group)]
        rewards = torch.tensor(
            [self.reward_fn(t, r) for t, r in zip(texts, records)], dtype=torch.float32
        ).view(-1, group)
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (
            rewards.std(1, unbiased=False, keepdim=True) + 1e-6
        )
        advantages = advantages.to(self.device)
        rolled = time.perf_counter()

        attention = torch.cat([attention.repeat_interleave(group, 0), completion_mask.long()], 1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(
            input_ids=sequences, attention_mask=attention, position_ids=positions
        ).logits[:, width - 1 : -1]
        logp = torch.log_softmax(logits.float() / rollout.temperature, -1)
        logp = logp.gather(-1, completions[..., None]).squeeze(-1)
        surrogate = -(advantages.reshape(-1, 1) * torch.exp(logp - logp.detach()))
        loss = (surrogate * completion_mask).sum() / completion_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the update's kernels done, as fnt's metrics sync
        return rolled - started, time.perf_counter() - rolled, float(rewards.mean())


def fnt_step(state, rl_source, rl_step, to_floats):
    """One fnt RL step as the driver runs it; (next state, rollout s, update s, mean reward)."""
    started = time.perf_counter()
    batch = rl_source(state)
    rolled = time.perf_counter()
    state, metrics = rl_step(state, batch)
    row = to_floats(metrics)
    return state, rolled - started, time.perf_counter() - rolled, row


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def compare_engines(args, task: list[str], work: Path, url: str) -> dict:
    """fnt with the vLLM engine against fnt with the in-process engine, step by step in turn;
    prints the table and returns the JSON result."""
    from fnt import init_state, rl_source, setup_trainer, to_floats
    from fnt.rollout.engines.vllm import publish_to_vllm_
    from steps import rl_step

    vllm_args = [
        *VLLM_SETTINGS,
        "--rollout.engine=vllm",
        f"--rollout.vllm.urls={json.dumps([url])}",
    ]
    configs = {
        "vllm": fnt_config(task, work / "fnt-vllm", args.async_level, *vllm_args),
        "in_process": fnt_config(task, work / "fnt-in-process", args.async_level),
    }
    runtime = setup_trainer(configs["vllm"])
    states = {side: init_state(config, runtime) for side, config in configs.items()}
    publish_to_vllm_(states["vllm"])  # the driver publishes the start policy before step 1
    step_s = {side: [] for side in states}
    tokens_per_s = {side: [] for side in states}
    rewards = {side: [] for side in states}
    for i in range(args.warmup + args.steps):
        for side, state in states.items():
            started = time.perf_counter()
            state, _, _, row = fnt_step(state, rl_source, rl_step, to_floats)
            if side == "vllm":
                publish_to_vllm_(state)  # the next step's policy, for the server to load
            elapsed = time.perf_counter() - started
            states[side] = state
            rewards[side].append(row["reward/mean"])
            if i >= args.warmup:
                step_s[side].append(elapsed)
                tokens_per_s[side].append(row["rollout/tokens_per_second"])
    for state in states.values():
        state.handles.rollouts.close()

    rollout = configs["vllm"].rollout
    print(
        f"shape: {rollout.prompts_per_step} prompts x {rollout.group_size} samples, "
        f"temperature {rollout.temperature}, {rollout.max_new_tokens} new tokens, "
        f"async_level {args.async_level}, median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'engine':11} {'step s':>8} {'generation tok/s':>17} {'reward':>7}")
    for side in states:
        print(
            f"{side:11} {median(step_s[side]):8.3f} {median(tokens_per_s[side]):17.0f} "
            f"{statistics.fmean(rewards[side]):7.3f}"
        )
    step_ratio = median(step_s["vllm"]) / median(step_s["in_process"])
    speed_ratio = median(tokens_per_s["vllm"]) / median(tokens_per_s["in_process"])
    print(f"step time vllm / in_process = {step_ratio:.3f}; generation speed = {speed_ratio:.3f}")
    return {
        "engine": "vllm",
        "vllm_step_s": median(step_s["vllm"]),
        "in_process_step_s": median(step_s["in_process"]),
        "step_ratio": step_ratio,
        "vllm_generation_tok_s": median(tokens_per_s["vllm"]),
        "in_process_generation_tok_s": median(tokens_per_s["in_process"]),
        "generation_speed_ratio": speed_ratio,
        "vllm_reward_mean": statistics.fmean(rewards["vllm"]),
        "in_process_reward_mean": statistics.fmean(rewards["in_process"]),
        "async_level": args.async_level,
        "steps": args.steps,
    }


def compare_with_bare(args, task: list[str], model: Path, work: Path) -> dict:
    """fnt (in-process engine) against the bare loop; prints the table, returns the result."""
    from fnt import init_state, rl_source, setup_trainer, to_floats
    from fnt.rollout.prompts import step_prompts
    from steps import rl_step

    config = fnt_config(task, work / "fnt-run", args.async_level)
    runtime = setup_trainer(config)  # one torch thread, as the demo's runtime.num_threads
    state = init_state(config, runtime)
    engine = state.handles.rollouts
    bare = Bare(config, model, state.handles.runtime.device)  # fnt's: CUDA where there is one

    times = {k: [] for k in ("fnt_rollout", "fnt_update", "bare_rollout", "bare_update")}
    staleness = []
    rewards = {"fnt": [], "bare": []}
    for i in range(args.warmup + args.steps):
        # The same prompts for both: the ones fnt's engine takes for this step.
        ids, _ = step_prompts(engine.order, state.progress.data, config.rollout.prompts_per_step)
        step_prompts_ = [engine.prompts[j] for j in ids]
        state, f_roll, f_upd, row = fnt_step(state, rl_source, rl_step, to_floats)
        b_roll, b_upd, b_reward = bare.step(step_prompts_, seed=config.seed * 1000 + i)
        rewards["fnt"].append(row["reward/mean"])
        rewards["bare"].append(b_reward)
        if "rollout/staleness" in row:
            staleness.append(row["rollout/staleness"])
        if i >= args.warmup:
            for key, value in zip(times, (f_roll, f_upd, b_roll, b_upd)):
                times[key].append(value)
    engine.close()

    med = {k: median(v) for k, v in times.items()}
    fnt_total = median([a + b for a, b in zip(times["fnt_rollout"], times["fnt_update"])])
    bare_total = median([a + b for a, b in zip(times["bare_rollout"], times["bare_update"])])
    rollout = config.rollout
    print(
        f"shape: {rollout.prompts_per_step} prompts x {rollout.group_size} samples, "
        f"temperature {rollout.temperature}, {rollout.max_new_tokens} new tokens, "
        f"{torch.get_num_threads()} thread(s), async_level {args.async_level}, "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'':6} {'step s':>8} {'rollout s':>10} {'update s':>9}")
    print(f"{'fnt':6} {fnt_total:8.3f} {med['fnt_rollout']:10.3f} {med['fnt_update']:9.3f}")
    print(f"{'bare':6} {bare_total:8.3f} {med['bare_rollout']:10.3f} {med['bare_update']:9.3f}")
    ratio = fnt_total / bare_total
    print(f"fnt / bare = {ratio:.3f}")
    result = {
        "fnt_step_s": fnt_total,
        "bare_step_s": bare_total,
        "ratio": ratio,
        "fnt_rollout_s": med["fnt_rollout"],
        "fnt_update_s": med["fnt_update"],
        "bare_rollout_s": med["bare_rollout"],
        "bare_update_s": med["bare_update"],
        "fnt_reward_mean": statistics.fmean(rewards["fnt"]),
        "bare_reward_mean": statistics.fmean(rewards["bare"]),
        "async_level": args.async_level,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
    }
    if staleness:
        result["fnt_staleness_mean"] = statistics.fmean(staleness)
    return result


def compare_compile(args, task: list[str], work: Path) -> dict:
    """fnt with model.compile against fnt eager (module docstring), step by step in turn;
    prints the table and returns the JSON result."""
    from fnt import init_state, rl_source, setup_trainer, to_floats
    from fnt.model.compile import compile_totals
    from steps import rl_step

    configs = {
        "eager": fnt_config(task, work / "fnt-eager", args.async_level),
        "compiled": fnt_config(
            task, work / "fnt-compiled", args.async_level, "--model.compile=true"
        ),
    }
    runtime = setup_trainer(configs["eager"])
    states = {side: init_state(config, runtime) for side, config in configs.items()}
    keys = ("rollout", "update", "reward", "generation_tok_s")
    seen = {side: {k: [] for k in keys} for side in states}
    compiled_seconds, compiled_graphs = 0.0, 0
    for i in range(args.warmup + args.steps):
        for side, state in states.items():
            before = compile_totals()
            started = time.perf_counter()
            batch = rl_source(state)
            rolled, during_rollout = time.perf_counter(), compile_totals()
            state, metrics = rl_step(state, batch)
            row = to_floats(metrics)
            updated, after = time.perf_counter(), compile_totals()
            states[side] = state
            # Compiling is counted apart (as rows' time/compile) and left out of step times.
            rollout_compile, update_compile = during_rollout - before, after - during_rollout
            compiled_seconds += rollout_compile.seconds + update_compile.seconds
            compiled_graphs += (after - before).graphs
            if i >= args.warmup:
                seen[side]["rollout"].append(rolled - started - rollout_compile.seconds)
                seen[side]["update"].append(updated - rolled - update_compile.seconds)
                seen[side]["generation_tok_s"].append(row["rollout/tokens_per_second"])
            seen[side]["reward"].append(row["reward/mean"])
    for state in states.values():
        state.handles.rollouts.close()

    rollout = configs["eager"].rollout
    print(
        f"shape: {rollout.prompts_per_step} prompts x {rollout.group_size} samples, "
        f"{rollout.max_new_tokens} new tokens, {torch.get_num_threads()} thread(s), "
        f"async_level {args.async_level}, median of {args.steps} steps after {args.warmup}"
    )
    print(
        f"{'':9} {'step s':>8} {'rollout s':>10} {'update s':>9} {'generation tok/s':>17} "
        f"{'reward':>7}"
    )
    result: dict = {"case": "compile"}
    for side, values in seen.items():
        step = median([a + b for a, b in zip(values["rollout"], values["update"])])
        roll, update = median(values["rollout"]), median(values["update"])
        tok_s, reward = median(values["generation_tok_s"]), statistics.fmean(values["reward"])
        print(f"{side:9} {step:8.3f} {roll:10.3f} {update:9.3f} {tok_s:17.0f} {reward:7.3f}")
        result |= {
            f"{side}_step_s": step,
            f"{side}_rollout_s": roll,
            f"{side}_update_s": update,
            f"{side}_generation_tok_s": tok_s,
            f"{side}_reward_mean": reward,
        }
    saving = result["eager_step_s"] - result["compiled_step_s"]
    result |= {
        "speedup": result["eager_step_s"] / result["compiled_step_s"],
        "update_speedup": result["eager_update_s"] / result["compiled_update_s"],
        "rollout_speedup": result["eager_rollout_s"] / result["compiled_rollout_s"],
        "compile_seconds": compiled_seconds,
        "compile_graphs": compiled_graphs,
        "break_even_steps": math.ceil(compiled_seconds / saving) if saving > 0 else None,
        "async_level": args.async_level,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
    }
    print(
        f"compiled / eager: step {1 / result['speedup']:.3f}, update "
        f"{1 / result['update_speedup']:.3f}, rollout {1 / result['rollout_speedup']:.3f}; "
        f"compile {compiled_seconds:.1f} s in {compiled_graphs} graphs, break-even after "
        f"{result['break_even_steps']} steps"
    )
    return result


MULTI_TURN_ENV = "examples.reverse_text.environments:three_turns"


def demo_sft_model(work: Path, model: Path) -> Path:
    """The demo's SFT result (examples/reverse_text/sft.toml from `model`), exported under
    `work` unless it is there already."""
    sft_hf = work / "reverse-sft-hf"
    if (sft_hf / "config.json").is_file():
        return sft_hf
    data = work / "reverse-data"
    sources = json.dumps([{"path": str(data / "sft.jsonl")}])
    sft_args = ["--config", str(DEMO / "sft.toml"), f"--model.name={model}"]
    sft_args += [f"--output-dir={work / 'reverse-sft'}", f"--data.sources={sources}"]

    def run(script: str, *args: str) -> None:
        command = [sys.executable, str(REPO / "scripts" / script), *args]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)

    run("sft.py", *sft_args)
    steps = json.loads((work / "reverse-sft" / "config.json").read_text())["max_steps"]
    checkpoint = work / "reverse-sft" / "checkpoints" / f"step_{steps}"
    run("export_hf.py", "--checkpoint", str(checkpoint), "--out", str(sft_hf))
    return sft_hf


def compare_turns(args, task: list[str], work: Path) -> dict:
    """3-turn episodes against single-turn ones of as many sampled tokens (module docstring),
    step by step in turn; prints the table and returns the JSON result."""
    from fnt import init_state, rl_source, setup_trainer, to_floats
    from steps import rl_step

    if str(REPO) not in sys.path:  # the environment's module: examples.reverse_text
        sys.path.insert(0, str(REPO))
    # Capacity for every sample in a row of its own; the micro-batches follow the lengths. A
    # learning policy drifts (its answers grow until max_new_tokens cuts them, which ends an
    # episode: 3.0 turns fell to 1.0 within 14 steps), so both sides keep the starting policy
    # (optim.lr = 0: the update's work is all done, its step is zero) and the task stays 3 turns.
    shape = ["--batch_size=192", "--micro_batch_size=8", "--rollout.group_size=8"]
    shape += ["--optim.lr=0", "--schedule.min_lr=0"]
    multi = [f"--rollout.environment={MULTI_TURN_ENV}", "--rollout.max_turns=3"]
    max_new_tokens = fnt_config(task, work / "unused", 0).rollout.max_new_tokens

    def single_turn(prompts: int):
        out = work / f"fnt-single-turn-{prompts}"
        return fnt_config(task, out, 0, *shape, f"--rollout.prompts_per_step={prompts}")

    multi += ["--rollout.prompts_per_step=8"]
    multi_config = fnt_config(task, work / "fnt-multi-turn", 0, *shape, *multi)
    # The same episodes under the old schedule (every turn a barrier over all episodes).
    lockstep_config = fnt_config(
        task, work / "fnt-multi-turn-lockstep", 0, *shape, *multi, "--rollout.lockstep=true"
    )
    runtime = setup_trainer(multi_config)
    states = {
        "multi_turn": init_state(multi_config, runtime),
        "multi_turn_lockstep": init_state(lockstep_config, runtime),
    }
    # As many sampled tokens a step: single-turn prompts enough for the multi-turn side's
    # sampled tokens, from warm-up steps of both (a turn after a hint is shorter than a first).
    probe = init_state(single_turn(24), runtime)
    sampled: dict[str, list[float]] = {"multi_turn": [], "single_turn": []}
    for _ in range(max(args.warmup, 1)):
        states["multi_turn"], *_, row = fnt_step(
            states["multi_turn"], rl_source, rl_step, to_floats
        )
        sampled["multi_turn"].append(row["rollout/sampled_tokens"])
        # The same warm-up, so that both schedules sample the same prompts at every step.
        states["multi_turn_lockstep"], *_ = fnt_step(
            states["multi_turn_lockstep"], rl_source, rl_step, to_floats
        )
        probe, *_, row = fnt_step(probe, rl_source, rl_step, to_floats)
        sampled["single_turn"].append(row["rollout/sampled_tokens"] / 24)
    probe.handles.rollouts.close()
    prompts = max(
        1, round(statistics.fmean(sampled["multi_turn"]) / statistics.fmean(sampled["single_turn"]))
    )
    states["single_turn"] = init_state(single_turn(prompts), runtime)
    keys = ("step_s", "rollout_s", "update_s", "sampled", "context", "turns", "reward")
    seen = {side: {k: [] for k in keys} for side in states}
    for i in range(1 + args.steps):  # one more warm-up step: the single-turn side's first
        for side, state in states.items():
            state, rolled, updated, row = fnt_step(state, rl_source, rl_step, to_floats)
            states[side] = state
            if i >= 1:
                for key, value in zip(
                    keys,
                    (
                        rolled + updated,
                        rolled,
                        updated,
                        row["rollout/sampled_tokens"],
                        row["rollout/context_tokens"],
                        row["rollout/turns/mean"],
                        row["reward/mean"],
                    ),
                ):
                    seen[side][key].append(value)
    for state in states.values():
        state.handles.rollouts.close()

    result: dict = {"case": "multi_turn", "steps": args.steps, "threads": torch.get_num_threads()}
    result["single_turn_prompts"] = prompts
    print(
        f"multi_turn: 8 prompts x 8 episodes of 3 turns, single_turn: {prompts} prompts x 8 of "
        f"one; the starting policy (optim.lr = 0); "
        f"<= {max_new_tokens} new tokens a turn; "
        f"{torch.get_num_threads()} thread(s), median of {args.steps} steps after {args.warmup}"
    )
    print(
        f"{'':19} {'step s':>7} {'rollout s':>9} {'update s':>8} {'sampled tok':>11} "
        f"{'context tok':>11} {'turns':>6} {'sampled tok/s':>13} {'all tok/s':>9}"
    )
    for side, values in seen.items():
        # tokens/s of each step, then the median: the step's tokens over its seconds
        rate = median([n / t for n, t in zip(values["sampled"], values["step_s"])])
        every = [n + c for n, c in zip(values["sampled"], values["context"])]
        all_rate = median([n / t for n, t in zip(every, values["step_s"])])
        row = {
            "step_s": median(values["step_s"]),
            "rollout_s": median(values["rollout_s"]),
            "update_s": median(values["update_s"]),
            "sampled_tokens": statistics.fmean(values["sampled"]),
            "context_tokens": statistics.fmean(values["context"]),
            "turns_mean": statistics.fmean(values["turns"]),
            "sampled_tok_s": rate,
            "all_tok_s": all_rate,
            "reward_mean": statistics.fmean(values["reward"]),
        }
        print(
            f"{side:19} {row['step_s']:7.3f} {row['rollout_s']:9.3f} {row['update_s']:8.3f} "
            f"{row['sampled_tokens']:11.0f} {row['context_tokens']:11.0f} "
            f"{row['turns_mean']:6.2f} {rate:13.0f} {all_rate:9.0f}"
        )
        result |= {f"{side}_{k}": v for k, v in row.items()}
    ratio = result["single_turn_sampled_tok_s"] / result["multi_turn_sampled_tok_s"]
    all_ratio = result["single_turn_all_tok_s"] / result["multi_turn_all_tok_s"]
    print(f"sampled tokens/s single_turn / multi_turn = {ratio:.3f} (target <= 1.3)")
    print(f"all tokens/s (sampled and context) single_turn / multi_turn = {all_ratio:.3f}")
    result["tok_s_ratio"] = ratio
    result["all_tok_s_ratio"] = all_ratio
    lockstep_ratio = (
        result["single_turn_sampled_tok_s"] / result["multi_turn_lockstep_sampled_tok_s"]
    )
    print(f"sampled tokens/s single_turn / multi_turn_lockstep = {lockstep_ratio:.3f}")
    result["lockstep_tok_s_ratio"] = lockstep_ratio
    # The same seed, prompts and policy: the schedule must not change what is sampled.
    independent, lockstep = seen["multi_turn"], seen["multi_turn_lockstep"]
    same = (independent["sampled"], independent["reward"]) == (
        lockstep["sampled"],
        lockstep["reward"],
    )
    print(f"the same samples under both schedules: {same}")
    result["same_samples"] = same
    return result


LONG_TAIL_ENV = "scripts.bench_rl_env:long_tail"


def compare_schedules(args, task: list[str], work: Path) -> dict:
    """Long-tailed episodes with environment latency under rollout.lockstep = true against the
    default schedule, episodes that advance on their own (module docstring); prints the table
    and returns the JSON result."""
    from fnt import init_state, rl_source, setup_trainer, to_floats
    from steps import rl_step

    if str(REPO) not in sys.path:  # the environment's module: scripts.bench_rl_env
        sys.path.insert(0, str(REPO))
    from scripts import bench_rl_env

    bench_rl_env.LATENCY_MS = args.latency_ms  # what the factory gives the environments it makes
    # 16 prompts x 4 episodes: the long tail is across prompts (an episode's turns are its
    # record's), so more prompts than the multi-turn case's 8. An 8-turn episode holds about
    # 300 tokens: seq_len 512; a row of its own for every episode. The starting policy, as
    # --multi-turn (optim.lr = 0): a learning one's answers grow until max_new_tokens cuts
    # them, which ends episodes early.
    shape = ["--seq_len=512", "--batch_size=64", "--micro_batch_size=8"]
    shape += ["--rollout.prompts_per_step=16", "--rollout.group_size=4"]
    shape += ["--optim.lr=0", "--schedule.min_lr=0"]
    shape += [
        f"--rollout.environment={LONG_TAIL_ENV}",
        f"--rollout.max_turns={bench_rl_env.MAX_TURNS}",
    ]
    configs = {
        side: fnt_config(task, work / f"fnt-{side}", 0, *shape, f"--rollout.lockstep={lockstep}")
        for side, lockstep in (("lockstep", "true"), ("independent", "false"))
    }
    runtime = setup_trainer(configs["independent"])
    states = {side: init_state(config, runtime) for side, config in configs.items()}
    keys = ("step_s", "rollout_s", "update_s", "sampled", "turns", "reward", "slept_s")
    seen = {side: {k: [] for k in keys} for side in states}
    for i in range(args.warmup + args.steps):
        # Both sides step i on the same prompts; which goes first alternates, so that machine
        # noise and what one side leaves in the caches hit both alike.
        for side in list(states)[:: 1 if i % 2 == 0 else -1]:
            slept = bench_rl_env.slept_seconds()
            state, rolled, updated, row = fnt_step(states[side], rl_source, rl_step, to_floats)
            states[side] = state
            if i >= args.warmup:
                values = (
                    rolled + updated,
                    rolled,
                    updated,
                    row["rollout/sampled_tokens"],
                    row["rollout/turns/mean"],
                    row["reward/mean"],
                    bench_rl_env.slept_seconds() - slept,
                )
                for key, value in zip(keys, values):
                    seen[side][key].append(value)
    for state in states.values():
        state.handles.rollouts.close()

    rollout = configs["independent"].rollout
    result: dict = {"case": "long_tail", "steps": args.steps, "threads": torch.get_num_threads()}
    result |= {
        "episodes_per_step": rollout.prompts_per_step * rollout.group_size,
        "env_concurrency": rollout.env_concurrency,
        "latency_ms": bench_rl_env.LATENCY_MS,
    }
    print(
        f"long_tail: {rollout.prompts_per_step} prompts x {rollout.group_size} episodes of 1-"
        f"{bench_rl_env.MAX_TURNS} turns, each environment call {bench_rl_env.LATENCY_MS} ms "
        f"(1 in {bench_rl_env.SLOW_ONE_IN} x{bench_rl_env.SLOW_FACTOR}); env_concurrency "
        f"{rollout.env_concurrency}; the starting policy (optim.lr = 0); <= "
        f"{rollout.max_new_tokens} new tokens a turn; {torch.get_num_threads()} thread(s), "
        f"median of {args.steps} steps after {args.warmup}"
    )
    print(
        f"{'':12} {'step s':>7} {'rollout s':>9} {'update s':>8} {'env s':>6} "
        f"{'sampled tok':>11} {'ms/sampled tok':>14} {'turns':>6} {'reward':>7}"
    )
    for side, values in seen.items():
        per_token = median([t / n for t, n in zip(values["step_s"], values["sampled"])])
        row = {
            "step_s": median(values["step_s"]),
            "rollout_s": median(values["rollout_s"]),
            "update_s": median(values["update_s"]),
            "env_latency_s": median(values["slept_s"]),
            "sampled_tokens": statistics.fmean(values["sampled"]),
            "s_per_sampled_token": per_token,
            "turns_mean": statistics.fmean(values["turns"]),
            "reward_mean": statistics.fmean(values["reward"]),
        }
        print(
            f"{side:12} {row['step_s']:7.3f} {row['rollout_s']:9.3f} {row['update_s']:8.3f} "
            f"{row['env_latency_s']:6.2f} {row['sampled_tokens']:11.0f} {1000 * per_token:14.2f} "
            f"{row['turns_mean']:6.2f} {row['reward_mean']:7.3f}"
        )
        result |= {f"{side}_{k}": v for k, v in row.items()}
    lockstep, independent = seen["lockstep"], seen["independent"]
    # The same seed, prompts and policy: the schedule must not change what is sampled.
    result["same_samples"] = (lockstep["sampled"], lockstep["reward"]) == (
        independent["sampled"],
        independent["reward"],
    )
    for name, key in (
        ("step_s_ratio", "step_s"),
        ("rollout_s_ratio", "rollout_s"),
        ("per_sampled_token_ratio", "s_per_sampled_token"),
    ):
        result[name] = result[f"lockstep_{key}"] / result[f"independent_{key}"]
    print(
        f"lockstep / independent: step {result['step_s_ratio']:.3f}, rollout "
        f"{result['rollout_s_ratio']:.3f}, per sampled token "
        f"{result['per_sampled_token_ratio']:.3f} (target >= 1.5); the same samples: "
        f"{result['same_samples']}"
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="measured steps per side")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--model", type=Path, help="model directory (default: the demo's base model)")
    p.add_argument("--prompts", type=Path, help="prompts JSONL (default: the demo's RL prompts)")
    p.add_argument("--work", type=Path, help="where the demo's model, data and run go")
    p.add_argument("--async-level", type=int, default=0, help="fnt's rollout.async_level")
    p.add_argument(
        "--engine",
        choices=("in_process", "vllm"),
        default="in_process",
        help="in_process: fnt against a bare loop; vllm: fnt's vLLM engine against in-process",
    )
    p.add_argument("--vllm-url", help="a running vLLM server for the run (else one is started)")
    p.add_argument("--vllm", help="the vllm program to start (default: $FNT_VLLM, .venv-vllm)")
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="3-turn episodes against single-turn ones of as many sampled tokens (in-process)",
    )
    p.add_argument(
        "--long-tail",
        action="store_true",
        help="episodes of 1-8 turns with environment latency: lockstep against independent",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=20.0,
        help="--long-tail: each environment call's latency (1 in 8 calls takes 5x as long)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="fnt with model.compile against fnt eager (in-process engine)",
    )
    args = p.parse_args()
    if args.latency_ms < 0:
        p.error(f"--latency-ms {args.latency_ms}: must be at least 0")

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        model, prompts = demo_inputs(work)
        model, prompts = args.model or model, args.prompts or prompts
        if args.multi_turn or args.long_tail:
            model = args.model or demo_sft_model(work, model)
        task = task_args(model, prompts)
        if args.multi_turn:
            result = compare_turns(args, task, work)
        elif args.long_tail:
            result = compare_schedules(args, task, work)
        elif args.compile:
            result = compare_compile(args, task, work)
        elif args.engine == "in_process":
            result = compare_with_bare(args, task, model, work)
        elif args.vllm_url:
            result = compare_engines(args, task, work, args.vllm_url)
        else:
            from fnt.apps.vllm_serve import has_cuda, local_server

            extra = [] if has_cuda() else ["--enforce-eager"]  # as the demo starts it
            log = work / "vllm-server.log"
            with local_server([*task, *VLLM_SETTINGS], log, vllm=args.vllm, extra=extra) as server:
                result = compare_engines(args, task, work, server.url)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
