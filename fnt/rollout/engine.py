"""The in-process rollout engine and the RL batch stream. Side effects: loads an unsharded
inference copy of the model, copies the live policy's weights into it before every rollout (a
collective under FSDP2), reads the prompts file, generates, and all-reduces the rollout metrics
across ranks when distributed.

One step's rollout, on every rank at the same point of the fold:
1. sync: the policy's full state dict (gathered from its FSDP2 shards) is loaded into the copy;
2. the step's global prompts are the next prompts_per_step of the prompt order; this rank takes
   its contiguous share;
3. per prompt, group_size completions are sampled from the copy, with a generator seeded by
   (seed, step, the prompt's slot in the step), so a step's samples do not depend on the number
   of ranks and a resumed run draws exactly what an uninterrupted one would;
4. each completion is scored by the reward function, advantages are relative within the group;
5. the samples are packed into this rank's batch_size // dp rows.
Generation runs on the copy, outside FSDP2, so ranks may generate different lengths without
their collectives getting out of step.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fnt.batch import RLBatch
from fnt.config import ConfigError, ModelConfig, RolloutConfig, validate_rollout
from fnt.data.sft import check_batch_layout
from fnt.errors import DataError
from fnt.model import DTYPES
from fnt.rewards import RewardFn, reward_function
from fnt.rollout.advantages import group_advantages
from fnt.rollout.generate import generate, sampling_seed
from fnt.rollout.pack import RolloutSample, pack_rollouts
from fnt.rollout.prompts import Prompt, load_prompts, prompt_order, rank_share, step_prompts
from fnt.state import TrainState
from fnt.update import all_reduce_sum


class InProcessEngine:
    """An unsharded inference copy of the policy, in eval mode, to generate rollouts with."""

    def __init__(self, model_config: ModelConfig, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(
            model_config.name,
            dtype=DTYPES[model_config.dtype],
            attn_implementation=model_config.attn_implementation,
        )
        self.model: nn.Module = model.to(device).eval().requires_grad_(False)

    def sync_weights_(self, policy: nn.Module) -> None:
        """Load the live policy's weights into the copy; every rank calls it at the same point."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
        self.model.load_state_dict(full)


def check_prompt_lengths(
    prompts: Sequence[Prompt], path: str, *, max_new_tokens: int, seq_len: int
) -> None:
    """DataError for the first prompt whose longest possible sample would not fit in seq_len."""
    for prompt in prompts:
        length = len(prompt.token_ids)
        longest = length + max_new_tokens
        if longest > seq_len:
            raise DataError(
                f"{path}, line {prompt.line}: the prompt has {length} tokens, so with "
                f"rollout.max_new_tokens = {max_new_tokens} a sample can have {longest} tokens, "
                f"more than seq_len = {seq_len}: raise seq_len or lower rollout.max_new_tokens"
            )


def score(
    texts: Sequence[str], prompt: Prompt, reward_fn: RewardFn, reward_name: str
) -> list[float]:
    """The reward of each completion text of one prompt.

    An error of the reward function, or a reward that is not a finite real number, raises a
    ValueError naming the reward and the prompt's line in the prompts file.
    """
    rewards = []
    where = f"the prompt of line {prompt.line} of rollout.prompts"
    for text in texts:
        try:
            value = reward_fn(text, prompt.record)
        except Exception as e:
            raise ValueError(f"reward {reward_name!r} failed on {where}: {e}") from e
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(
                f"reward {reward_name!r} returned {value!r} for {text!r} on {where}; "
                "expected a finite float"
            )
        rewards.append(float(value))
    return rewards


def rollout_group(
    model: nn.Module,
    prompt: Prompt,
    tokenizer,
    reward_fn: RewardFn,
    rollout: RolloutConfig,
    generator: torch.Generator,
) -> list[RolloutSample]:
    """Sample, decode, score one prompt's group of completions and give them their advantages."""
    completions = generate(
        model,
        prompt.token_ids,
        num_samples=rollout.group_size,
        max_new_tokens=rollout.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        temperature=rollout.temperature,
        generator=generator,
    )
    texts = [tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions]
    rewards = score(texts, prompt, reward_fn, rollout.reward)
    advantages = group_advantages([rewards], std_normalize=rollout.std_normalize)[0].tolist()
    return [
        RolloutSample(prompt.token_ids, c, reward, advantage)
        for c, reward, advantage in zip(completions, rewards, advantages)
    ]


def rollout_metrics(
    samples: Sequence[RolloutSample], seconds: float, *, distributed: bool, device: torch.device
) -> dict[str, float]:
    """reward/*, time/rollout and rollout/* over all ranks; a collective when distributed.

    time/rollout is the slowest rank's (the step waits for it); tokens_per_second counts the
    generated tokens of all ranks over that time.
    """
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = [len(s.completion.token_ids) for s in samples]
    sums = torch.tensor(
        [
            len(samples),
            float(rewards.sum()),
            float((rewards**2).sum()),
            sum(lengths),
            sum(not s.completion.stopped for s in samples),
        ],
        dtype=torch.float64,
        device=device,
    )
    sums = all_reduce_sum(sums, distributed)
    wall = torch.tensor([seconds], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    count, reward_sum, reward_sq, tokens, truncated = sums.tolist()
    seconds = float(wall)
    mean = reward_sum / count
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(reward_sq / count - mean**2, 0.0)),
        "time/rollout": seconds,
        "rollout/tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "rollout/completion_len/mean": tokens / count,
        "rollout/truncated_fraction": truncated / count,
    }


def rl_batches(state: TrainState) -> Iterator[RLBatch]:
    """This rank's RL batches for steps progress.step + 1, + 2, ... from the in-process engine.

    Reads the tokenizer (config.model.name), the prompts and the reward, and loads the inference
    copy when called, so setup errors surface before the first step. Each batch is generated
    when it is pulled, with the policy as it is then (after the previous update).
    """
    from transformers import AutoTokenizer

    config, runtime = state.config, state.handles.runtime
    rollout: RolloutConfig = config.rollout
    dp_rank, dp_size = runtime.dp_rank, runtime.dims.dp
    if rollout.engine != "in_process":
        raise ConfigError(
            f"'rollout.engine' = {rollout.engine!r}: rl_batches runs the in-process engine only"
        )
    validate_rollout(rollout, dp_size=dp_size)
    check_batch_layout(config.batch_size, config.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    reward_fn = reward_function(rollout.reward)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer of {config.model.name} has no eos token to stop generation at"
        )
    pad_token_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    prompts = load_prompts(rollout.prompts, tokenizer)
    check_prompt_lengths(
        prompts, rollout.prompts, max_new_tokens=rollout.max_new_tokens, seq_len=config.seq_len
    )
    order = prompt_order(len(prompts), config.seed)
    order.check(state.progress.data)
    engine = InProcessEngine(config.model, runtime.device)
    policy = state.handles.model

    def batches() -> Iterator[RLBatch]:
        step, position = state.progress.step, state.progress.data
        per_rank = rollout.prompts_per_step // dp_size
        while True:
            step += 1
            started = time.perf_counter()
            engine.sync_weights_(policy)
            prompt_ids, after = step_prompts(order, position, rollout.prompts_per_step)
            samples: list[RolloutSample] = []
            for i, prompt_id in enumerate(rank_share(prompt_ids, dp_rank, dp_size)):
                seed = sampling_seed(config.seed, step, dp_rank * per_rank + i)
                generator = torch.Generator(device=runtime.device).manual_seed(seed)
                samples += rollout_group(
                    engine.model, prompts[prompt_id], tokenizer, reward_fn, rollout, generator
                )
            micro_batches = pack_rollouts(
                samples,
                num_rows=config.batch_size // dp_size,
                seq_len=config.seq_len,
                micro_batch_size=config.micro_batch_size,
                temperature=rollout.temperature,
                pad_token_id=pad_token_id,
            )
            metrics = rollout_metrics(
                samples,
                time.perf_counter() - started,
                distributed=runtime.distributed,
                device=runtime.device,
            )
            yield RLBatch(
                micro_batches=micro_batches,
                num_samples=len(samples),
                data_after=after,
                metrics=metrics,
            )
            position = after

    return batches()
