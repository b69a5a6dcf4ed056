"""The external rollout protocol: batches from an orchestrator, weights published back
(fnt.rollout.publish). Side effects: reads {output_dir}/rollouts/, collectives.

The file format is documented in docs/external_rollouts.md. In short: for step N the trainer
waits for `rollouts/step_N/COMPLETE` (sampled, says `rollouts/step_N/policy_step` if present,
by weights/step_P with P >= N - 1 - rollout.async_level; older ones are never used, the trainer
waits for them to be replaced), reads `rollouts/step_N/samples.jsonl` (every rank reads
the whole file and takes its contiguous share), trains, then publishes the policy as a Hugging
Face directory `weights/step_N/` (with LoRA a PEFT adapter directory by default, or the merged
model: rollout.publish; `fnt_published.json` says which), marked complete by a `COMPLETE` file
written after everything else and the rename from `step_N.partial`. The starting policy is
published as `weights/step_{start}/` before the first wait, so the orchestrator always has weights
to load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from fnt.batch import BadToken, DataPosition, RLBatch
from fnt.config import RLConfig, RolloutConfig
from fnt.distributed.parallel import check_batch_layout, rank_share
from fnt.distributed.runtime import Runtime
from fnt.errors import DataError
from fnt.model.tokenizer import load_tokenizer, pad_token_id
from fnt.rollout.advantages import group_advantages
from fnt.rollout.base import (
    LOGPROB_SLACK,
    as_float32,
    episode_metrics,
    episode_sums,
    pack_share,
    save_and_pack_,
    share_micro_batch_count,
)
from fnt.rollout.pack import (
    RolloutSample,
    plan_micro_batches,
    single_turn,
)
from fnt.rollout.sampling import Completion
from fnt.state import Progress, Stateless, TrainState
from fnt.store.rundir import (
    COMPLETE_MARKER,
    POLICY_STEP_FILE,
    ROLLOUTS_DIR,
    SAMPLES_FILE,
    step_dir,
)

POLL_SECONDS = 0.05


class RolloutTimeout(TimeoutError):
    """The orchestrator did not deliver a step's rollouts in time."""


def rollout_dir(output_dir: str, step: int) -> Path:
    return step_dir(Path(output_dir) / ROLLOUTS_DIR, step)


def wait_for_rollouts(path: Path, timeout_s: float) -> float:
    """Block until `path/COMPLETE` exists; the seconds waited, or RolloutTimeout after timeout_s."""
    started = time.perf_counter()
    while not (path / COMPLETE_MARKER).is_file():
        waited = time.perf_counter() - started
        if waited > timeout_s:
            raise RolloutTimeout(
                f"no rollouts after {timeout_s:.0f} s: waited for {path / COMPLETE_MARKER} "
                f"(the orchestrator writes {path / SAMPLES_FILE}, then {COMPLETE_MARKER}); "
                "raise rollout.timeout_s or check the orchestrator"
            )
        time.sleep(POLL_SECONDS)
    return time.perf_counter() - started


def read_policy_step(path: Path) -> Optional[int]:
    """The policy step in `path/policy_step` (the weights/step_P that sampled the rollouts), or
    None when the orchestrator wrote no such file; DataError when it is not an integer >= 0."""
    file = path / POLICY_STEP_FILE
    try:
        text = file.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise DataError(f"{file}: expected the policy step, an integer >= 0, got {text!r}")
    return int(text)


def wait_for_fresh_rollouts(path: Path, step: int, async_level: int, timeout_s: float) -> int:
    """Block until `path` is complete and sampled by a policy no older than step - 1 - k; its
    policy step (step - 1 when the directory says none). Older rollouts are never used: the
    trainer waits for the orchestrator to replace them, up to timeout_s (RolloutTimeout)."""
    started = time.perf_counter()
    oldest = step - 1 - async_level
    while True:
        wait_for_rollouts(path, max(timeout_s - (time.perf_counter() - started), 0.0))
        policy_step = read_policy_step(path)
        if not (path / COMPLETE_MARKER).is_file():
            # Being replaced (the marker goes first): what was read may be of neither version.
            continue
        if policy_step is None:
            return step - 1
        if policy_step > step - 1:
            raise DataError(
                f"{path / POLICY_STEP_FILE}: policy step {policy_step}, but the rollouts of "
                f"update {step} can come at the newest from weights/step_{step - 1}"
            )
        if policy_step >= oldest:
            return policy_step
        if time.perf_counter() - started > timeout_s:
            raise RolloutTimeout(
                f"{path} holds rollouts of policy step {policy_step}, older than the "
                f"{oldest} that rollout.async_level = {async_level} allows for update {step}; "
                f"waited {timeout_s:.0f} s for fresher ones: replace them, or raise "
                "rollout.async_level"
            )
        time.sleep(POLL_SECONDS)


def _int_list(value: Any, key: str, where: str) -> list[int]:
    """record[key] as token ids: integers, none negative. (An id past the model's vocabulary is
    located by fnt.sources.checked_token_ids before the model reads it; a negative one would
    already break the tokenizer's decoding of the saved samples.)"""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise DataError(f"{where}: '{key}' must be a list of token ids (integers)")
    negative = next((i for i, v in enumerate(value) if v < 0), None)
    if negative is not None:
        raise DataError(
            f"{where}: '{key}'[{negative}] = {value[negative]} is not a token id (ids are >= 0)"
        )
    return value


def _logprob_list(record: dict, key: str, length: int, where: str) -> Optional[list[float]]:
    """record[key] as floats, one log-probability per completion token (finite once stored in
    float32, and at most LOGPROB_SLACK above 0), or None when absent."""
    values = record.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != length:
        raise DataError(f"{where}: '{key}' needs one value per completion token")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise DataError(f"{where}: '{key}' must be numbers")
    # A NaN or inf logprob would reach the loss and its gradient (a NaN ratio, an inf KL).
    for i, value in enumerate(values):
        if not math.isfinite(as_float32(value)) or value > LOGPROB_SLACK:
            raise DataError(
                f"{where}: '{key}' must be finite log-probabilities (<= 0, and finite in "
                f"float32, where they are stored), got {value!r} at completion token {i}"
            )
    return [float(v) for v in values]


def _flat_logprobs(record: dict, key: str, mask: list[bool], where: str) -> Optional[list[float]]:
    """record[key] of a flat sample: one entry per token, a log-probability at each sampled
    token and null at the others; as floats with 0.0 off the sampled tokens, or None when
    absent."""
    values = record.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != len(mask):
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise DataError(
            f"{where}: '{key}' needs one entry per token of 'token_ids' ({len(mask)}), "
            f"null where 'mask' is 0; got {got}"
        )
    for i, (value, sampled) in enumerate(zip(values, mask)):
        if sampled and value is None:
            raise DataError(
                f"{where}: '{key}' has no value at token {i}, which 'mask' marks sampled"
            )
        if not sampled and value is not None:
            raise DataError(
                f"{where}: '{key}' has {value!r} at token {i}, which 'mask' does not mark sampled "
                "(give null there: only sampled tokens have a sampler's logprob)"
            )
    sampled_values = [v for v, m in zip(values, mask) if m]
    checked = _logprob_list({key: sampled_values}, key, len(sampled_values), where)
    assert checked is not None
    it = iter(checked)
    return [next(it) if m else 0.0 for m in mask]


def _flat_sample(
    record: dict, numbers: dict[str, float], where: str
) -> tuple[RolloutSample, bool, Optional[list[float]]]:
    """A flat (multi-turn) line: token_ids, mask, logprobs and ref_logprobs on sampled tokens."""
    if "prompt_ids" in record or "completion_ids" in record:
        raise DataError(
            f"{where}: give either 'token_ids' with 'mask' (the flat form) or 'prompt_ids' with "
            "'completion_ids', not both"
        )
    if "mask" not in record:
        raise DataError(f"{where}: missing 'mask' (1 on the tokens the policy sampled)")
    token_ids = _int_list(record["token_ids"], "token_ids", where)
    mask = record["mask"]
    if not isinstance(mask, list) or not all(v in (0, 1) for v in mask):
        raise DataError(f"{where}: 'mask' must be a list of 0 and 1 (or false and true)")
    if len(mask) != len(token_ids):
        raise DataError(
            f"{where}: 'mask' has {len(mask)} values for the {len(token_ids)} tokens of "
            "'token_ids'; it needs one per token"
        )
    mask = [bool(v) for v in mask]
    if not any(mask):
        raise DataError(f"{where}: 'mask' marks no token as sampled; a sample needs at least one")
    if mask[0]:
        raise DataError(
            f"{where}: 'mask' marks token 0 as sampled, but nothing precedes it to sample it "
            "from; a sample starts with context (the prompt)"
        )
    logprobs = _flat_logprobs(record, "logprobs", mask, where)
    ref_logprobs = _flat_logprobs(record, "ref_logprobs", mask, where)
    facts: dict[str, Any] = {}
    for key in ("turns", "tool_calls", "tool_errors"):
        if key in record:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataError(f"{where}: '{key}' must be an integer >= 0, got {value!r}")
            facts[key] = value
    for key in ("truncated", "out_of_turns"):
        if key in record:
            if not isinstance(record[key], bool):
                raise DataError(f"{where}: '{key}' must be true or false")
            facts[key] = record[key]
    sample = RolloutSample(
        token_ids=tuple(token_ids),
        sampled=tuple(mask),
        logprobs=tuple(logprobs) if logprobs is not None else (0.0,) * len(mask),
        reward=numbers["reward"],
        advantage=numbers["advantage"],
        **facts,
    )
    return sample, logprobs is not None, ref_logprobs


class ParsedSample(NamedTuple):
    """One samples.jsonl line, read."""

    sample: RolloutSample
    temperature: float
    has_logprobs: bool  # whether it carries the sampler's logprobs
    ref_logprobs: Optional[list[float]]  # per token (0 off the sampled ones), or None
    has_advantage: bool  # False: only a reward, and `sample.advantage` is 0 until computed
    group: Union[str, int, None]  # its 'group', or None


def parse_sample(line: str, where: str) -> ParsedSample:
    """One samples.jsonl line, in either form. Pure."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object")
    flat = "token_ids" in record
    for key in ("token_ids",) if flat else ("prompt_ids", "completion_ids"):
        if key not in record:
            raise DataError(f"{where}: missing '{key}'")
    has_advantage = "advantage" in record
    if not has_advantage and "reward" not in record:
        raise DataError(
            f"{where}: missing 'advantage' (or 'reward', for fnt to compute the advantages of "
            "the step's groups)"
        )
    group = record.get("group")
    if isinstance(group, bool) or not isinstance(group, (str, int, type(None))):
        raise DataError(f"{where}: 'group' must be a string or an integer, got {group!r}")
    numbers = {}
    for key, default in (("advantage", 0.0), ("reward", 0.0), ("temperature", 1.0)):
        value = record.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"{where}: '{key}' must be a finite number, got {value!r}")
        # Advantages and temperatures are stored in float32; the reward is only reported.
        stored = value if key == "reward" else as_float32(value)
        if not math.isfinite(stored):
            raise DataError(
                f"{where}: '{key}' must be a finite number (in float32 where it is stored), "
                f"got {value!r}"
            )
        numbers[key] = float(value)
    if numbers["temperature"] <= 0:
        raise DataError(f"{where}: 'temperature' must be > 0")
    if flat:
        sample, has_logprobs, ref_logprobs = _flat_sample(record, numbers, where)
        return ParsedSample(
            sample, numbers["temperature"], has_logprobs, ref_logprobs, has_advantage, group
        )
    prompt_ids = _int_list(record["prompt_ids"], "prompt_ids", where)
    completion_ids = _int_list(record["completion_ids"], "completion_ids", where)
    if not prompt_ids or not completion_ids:
        raise DataError(f"{where}: 'prompt_ids' and 'completion_ids' must not be empty")
    logprobs = _logprob_list(record, "inference_logprobs", len(completion_ids), where)
    ref_logprobs = _logprob_list(record, "ref_logprobs", len(completion_ids), where)
    completion = Completion(
        token_ids=tuple(completion_ids),
        logprobs=tuple(logprobs) if logprobs is not None else (0.0,) * len(completion_ids),
        stopped=True,
    )
    sample = single_turn(prompt_ids, completion, numbers["reward"], numbers["advantage"])
    if ref_logprobs is not None:
        ref_logprobs = [0.0] * len(prompt_ids) + ref_logprobs
    return ParsedSample(
        sample, numbers["temperature"], logprobs is not None, ref_logprobs, has_advantage, group
    )


def sample_lines(file: Path) -> list[tuple[int, str]]:
    """(line number, line) of every sample of a samples.jsonl: its non-blank lines."""
    lines = enumerate(file.read_text().splitlines(), start=1)
    return [(number, line) for number, line in lines if line.strip()]


def reward_groups(
    parsed: list[ParsedSample], numbers: list[int], group_size: int, file: Path
) -> list[list[int]]:
    """The groups of a step's reward-only samples, as lists of their indices: the lines of equal
    'group' when they give one (every line must), else consecutive runs of rollout.group_size
    lines. DataError naming the file (and line) otherwise. Pure."""
    with_group = [p.group is not None for p in parsed]
    if any(with_group):
        if not all(with_group):
            number = numbers[with_group.index(False)]
            raise DataError(
                f"{file}, line {number}: no 'group', but other lines give one (either every "
                "line gives its 'group' or none does)"
            )
        members: dict[Union[str, int], list[int]] = {}
        for i, p in enumerate(parsed):
            members.setdefault(p.group, []).append(i)
        return list(members.values())
    if len(parsed) % group_size:
        raise DataError(
            f"{file}: {len(parsed)} reward-only samples without 'group' are not whole groups of "
            f"rollout.group_size = {group_size} consecutive lines (give each line a 'group', or "
            "its 'advantage')"
        )
    return [list(range(i, i + group_size)) for i in range(0, len(parsed), group_size)]


def with_group_advantages(
    parsed: list[ParsedSample], numbers: list[int], rollout: RolloutConfig, file: Path
) -> list[RolloutSample]:
    """The samples with their given advantages, or, when no line gives one, each with the
    group-relative advantage of its reward within its group (`reward_groups`), as fnt's own
    engines compute it (rollout.std_normalize). DataError when some lines give an advantage and
    others do not. Pure."""
    given = [p.has_advantage for p in parsed]
    if all(given):
        return [p.sample for p in parsed]
    if any(given):
        number = numbers[given.index(not given[0])]
        differs = (
            f"gives no 'advantage', but line {numbers[0]} does"
            if given[0]
            else f"gives an 'advantage', but line {numbers[0]} does not"
        )
        raise DataError(
            f"{file}, line {number} {differs} (either every line gives its 'advantage' or none "
            "does, and fnt computes them from 'reward')"
        )
    samples = [p.sample for p in parsed]
    for members in reward_groups(parsed, numbers, rollout.group_size, file):
        rewards = [[samples[i].reward for i in members]]
        advantages = group_advantages(rewards, std_normalize=rollout.std_normalize)[0].tolist()
        for i, advantage in zip(members, advantages):
            # Finite rewards can still overflow: a spread past float32's range, or a float64 sum.
            if not math.isfinite(as_float32(advantage)):
                raise DataError(
                    f"{file}, line {numbers[i]}: the advantage fnt computes from its 'reward' "
                    f"{samples[i].reward!r} and its group's is {advantage!r}, not finite in "
                    "float32 where it is stored; scale the rewards down, or give 'advantage'"
                )
            samples[i] = dataclasses.replace(samples[i], advantage=advantage)
    return samples


def read_rollouts(
    path: Path, rollout: RolloutConfig
) -> tuple[list[RolloutSample], float, bool, Optional[list[list[float]]]]:
    """All samples of a step (with the advantages fnt computes when the lines give rewards
    only), their common temperature, whether they carry inference logprobs, and their reference
    logprobs (None when the samples have none)."""
    file = path / SAMPLES_FILE
    if not file.is_file():
        raise DataError(f"{file}: missing, although {path / COMPLETE_MARKER} exists")
    parsed, numbers = [], []
    for number, line in sample_lines(file):
        parsed.append(parse_sample(line, f"{file}, line {number}"))
        numbers.append(number)
    if not parsed:
        raise DataError(f"{file}: no samples")
    temperatures = {p.temperature for p in parsed}
    with_logprobs = {p.has_logprobs for p in parsed}
    refs = [p.ref_logprobs for p in parsed]
    samples = with_group_advantages(parsed, numbers, rollout, file)
    if len(temperatures) > 1:
        raise DataError(
            f"{file}: all samples of a step must share one temperature, got {sorted(temperatures)}"
        )
    if len(with_logprobs) > 1:
        raise DataError(f"{file}: either every sample has 'inference_logprobs' or none has")
    if len({ref is None for ref in refs}) > 1:
        raise DataError(f"{file}: either every sample has 'ref_logprobs' or none has")
    return samples, temperatures.pop(), with_logprobs.pop(), None if refs[0] is None else refs


def rank_samples(
    samples: list[RolloutSample], dp_rank: int, dp_size: int, where: Path
) -> tuple[RolloutSample, ...]:
    """Rank dp_rank's contiguous share of a step's samples; DataError naming the file when they
    do not split evenly. Pure."""
    try:
        return rank_share(samples, dp_rank, dp_size, what="samples")
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def external_metrics(samples: list[RolloutSample], waited: float) -> dict[str, float]:
    """The episode metrics of a step's samples (fnt.rollout.base.episode_metrics) and
    time/rollout. Pure."""
    return {**episode_metrics(episode_sums(samples)), "time/rollout": waited}


def with_ref_logprobs(micro_batches, share, refs, pack) -> tuple:
    """The micro-batches with `ref_logprobs` from each sample's reference logprobs (one per
    token, 0 off the sampled ones). Pure.

    Packing depends only on the samples' lengths, so packing the same samples with the
    reference logprobs in place of the inference ones puts every value at its token."""
    as_inference = [dataclasses.replace(s, logprobs=tuple(ref)) for s, ref in zip(share, refs)]
    return tuple(
        dataclasses.replace(mb, ref_logprobs=ref_mb.inference_logprobs)
        for mb, ref_mb in zip(micro_batches, pack(as_inference))
    )


class ExternalRollouts(Stateless):
    """Reads each step's rollouts from the orchestrator's files; built once per run (a
    RolloutSource whose position is in Progress and whose files are the orchestrator's).

    `rollout(state)` waits for rollouts/step_{state.progress.step + 1}/ and returns this rank's
    share. Publishing the policy is fnt.rollout.publish's `publish_weights_` (this engine's
    `publish` in fnt.config.engines), which the driver calls for every state it
    reaches (the start state included), so the orchestrator always has weights to load.
    """

    def __init__(self, config: RLConfig, runtime: Runtime) -> None:
        check_batch_layout(
            config.batch_size,
            config.micro_batch_size,
            dp_rank=runtime.dp_rank,
            dp_size=runtime.dims.dp,
        )
        self.config, self.runtime = config, runtime
        self.tokenizer = load_tokenizer(config.model.name)
        self.pad_token_id = pad_token_id(self.tokenizer)

    def rollout(self, state: TrainState) -> RLBatch:
        """This rank's RL batch for update state.progress.step + 1 (blocks until it exists)."""
        config, runtime = self.config, self.runtime
        dp_rank, dp_size = runtime.dp_rank, runtime.dims.dp
        step = state.progress.step + 1
        path = rollout_dir(config.output_dir, step)
        started = time.perf_counter()
        policy_step = wait_for_fresh_rollouts(
            path, step, config.rollout.async_level, config.rollout.timeout_s
        )
        samples, temperature, has_logprobs, refs = read_rollouts(path, config.rollout)
        file = path / SAMPLES_FILE
        mine = rank_samples(samples, dp_rank, dp_size, file)
        # Every rank reads every sample, so all know the most micro-batches any share needs.
        packing = dict(
            temperature=temperature,
            pad_token_id=self.pad_token_id,
            num_micro_batches=max(
                share_micro_batch_count(rank_samples(samples, r, dp_size, file), config)
                for r in range(dp_size)
            ),
        )
        micro_batches = save_and_pack_(mine, step, config, runtime, self.tokenizer, **packing)
        if not has_logprobs:
            micro_batches = tuple(
                dataclasses.replace(mb, inference_logprobs=None) for mb in micro_batches
            )
        loss = config.loss
        if loss.ref_kl_tau and loss.ref_source == "rollouts":
            if refs is None:
                raise DataError(
                    f"{path / SAMPLES_FILE}: the samples have no 'ref_logprobs', but "
                    'loss.ref_kl_tau > 0 with loss.ref_source = "rollouts" needs them'
                )
            my_refs = rank_samples(refs, dp_rank, dp_size, path / SAMPLES_FILE)
            micro_batches = with_ref_logprobs(
                micro_batches,
                mine,
                my_refs,
                lambda share: pack_share(share, config, runtime, **packing),
            )
        return RLBatch(
            micro_batches=micro_batches,
            num_samples=len(mine),
            data_after=DataPosition(epoch=0, cursor=state.progress.data.cursor + len(samples)),
            metrics={
                **external_metrics(samples, time.perf_counter() - started),
                "rollout/staleness": float(step - 1 - policy_step),
            },
        )

    def locate(self, progress: Progress, bad: BadToken) -> str:
        """Where a token of this rank's batch after `progress` comes from: the samples.jsonl
        line and the key and index of the token in it (the file is read again: only for a
        message)."""
        dp_rank, dp_size = self.runtime.dp_rank, self.runtime.dims.dp
        file = rollout_dir(self.config.output_dir, progress.step + 1) / SAMPLES_FILE
        samples, *_ = read_rollouts(file.parent, self.config.rollout)
        mine = rank_samples(samples, dp_rank, dp_size, file)
        plans = plan_micro_batches(
            [s.length for s in mine],
            seq_len=self.config.seq_len,
            micro_batch_size=self.config.micro_batch_size,
        )
        rows = plans[bad.micro_batch].rows if bad.micro_batch < len(plans) else ()
        row = rows[bad.row] if bad.row < len(rows) else ()
        if bad.document >= len(row):
            return f"{file}: the padding of this rank's rows (the tokenizer's pad token)"
        # Rank shares are contiguous; the line says which form the sample was written in.
        number, line = sample_lines(file)[dp_rank * len(mine) + row[bad.document]]
        record = json.loads(line)
        key, at = "token_ids", bad.offset
        if "token_ids" not in record:
            prompt = len(record["prompt_ids"])
            key, at = ("prompt_ids", at) if at < prompt else ("completion_ids", at - prompt)
        return f"{file}, line {number}, '{key}'[{at}]"
