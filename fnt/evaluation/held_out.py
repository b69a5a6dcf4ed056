"""The held-out samples and prompts of an SFT or RL run (the `[val]` section): the token-weighted
loss on held-out samples (`val.sources`) and, in RL, the mean reward of greedy answers to
held-out prompts (`val.prompts`, or the environment's own), over all ranks. `EvalData` is the
state's `val` handle (an Evaluator).
Side effects: `load_eval_data` reads the val sources and prompts (init_state calls it before
the model loads, so a bad file fails first). An evaluation (`EvalData.evaluate`) runs forward
passes of the model without gradients, in eval mode and then back in the mode it was in; it
generates on the rollout engine's inference copy (fnt.config.engines: an engine with
`greedy_eval`) after loading the policy's weights into it (a collective under FSDP2); and it
all-reduces its sums. Every rank evaluates its share (rows of samples, prompts), and all ranks
finish an evaluation together, in that all-reduce. Nothing an evaluation does reaches training:
no gradient, no optimizer state, no generator is drawn from (greedy decoding draws nothing), and
the data position stays where it is.

Which rows get which keys is fnt.evaluation's `Evaluation` (the driver's side of evaluation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

import torch
from torch import nn

from fnt.batch import to_device
from fnt.config import Config, ConfigError, RLConfig, mode_of
from fnt.config.engines import engine_of
from fnt.config.modes import has_val_data, held_out_prompts
from fnt.data.corpus import Corpus
from fnt.data.load import load_corpus
from fnt.data.packing import pack_rows
from fnt.distributed.collectives import all_reduce_sum
from fnt.distributed.parallel import rank_share
from fnt.distributed.runtime import Runtime
from fnt.model.lm_head import loss_tokens_of
from fnt.model.tokenizer import load_tokenizer, pad_token_id
from fnt.rollout.base import all_ranks_named_sums, named_reward_means, named_sums
from fnt.rollout.environments import environment_of
from fnt.rollout.environments.parsers import read_turn, turn_parser
from fnt.rollout.environments.protocol import Scored, weighted_reward
from fnt.rollout.prompts import Prompt, load_prompts, source_prompts
from fnt.rollout.rewards import RewardFn, keep_group, reward_function, score
from fnt.rollout.sampling import generate
from fnt.state import Stateless, TrainState
from fnt.update import forward_loss_tokens


@dataclass(frozen=True)
class EvalData(Stateless):
    """What evaluation reads, loaded once: the held-out samples and prompts, and the tokenizer."""

    corpus: Optional[Corpus]
    """The val.sources samples, tokenized and fitted to seq_len; None without val.sources."""
    rows: tuple[tuple[int, ...], ...]
    """All ranks' rows: the corpus's sample ids packed in order (`pack_in_order`)."""
    prompts: tuple[Prompt, ...]
    """The val.prompts prompts; empty without val.prompts."""
    reward_fn: Optional[RewardFn]
    """rollout.reward, which scores the greedy answers; None without val.prompts."""
    tokenizer: Any
    pad_token_id: int
    environment: Optional[Any] = None
    """The environment whose held-out prompts these are, which scores them (else reward_fn)."""
    environment_name: str = ""
    """How messages name it ("environment 'reasoning_gym:TASK'")."""

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """The val metrics of the model as `state` holds it, without the val/ prefix; every
        rank calls it at the same point."""
        config, handles = state.config, state.handles
        metrics: dict[str, float] = {}
        if self.corpus is not None:
            loss_sum, num_tokens = eval_loss_sums(
                handles.model,
                self,
                handles.runtime,
                seq_len=config.seq_len,
                micro_batch_size=config.micro_batch_size,
                chunk_tokens=config.model.loss_chunk_tokens,
            )
            metrics.update(loss_metrics(loss_sum, num_tokens))
        if self.prompts:
            if not engine_of(config.rollout).greedy_eval:
                raise ConfigError(
                    f"'val.prompts' is set but rollout.engine = {config.rollout.engine!r} holds "
                    "no inference copy of the policy to generate the greedy answers"
                )
            reward_sum, count, named = eval_reward_sums(
                handles.rollouts, handles.model, self, handles.runtime, config
            )
            metrics["reward/mean"] = reward_sum / count if count else math.nan
            metrics.update(named_reward_means(named))
        return metrics


def load_eval_data(config: Config) -> Optional[Any]:
    """The val data of an SFT or RL config (fnt.config.modes: `eval_data`): the held-out
    samples of val.sources and, in a mode whose batches are rollouts, the prompts of
    val.prompts or the environment's held-out prompts; None when it has none. DataError for a
    bad file or line."""
    val = config.val
    held_out = held_out_prompts(config) > 0
    if not has_val_data(config):
        return None
    tokenizer = load_tokenizer(config.model.name)
    corpus = None
    if val.sources:
        corpus = load_corpus(
            val.sources,
            tokenizer,
            seq_len=config.seq_len,
            overlong=config.data.overlong,
            on_bad_sample=config.data.on_bad_sample,
        )
    prompts: tuple[Prompt, ...] = ()
    reward_fn = None
    if val.prompts:
        if not mode_of(config).rollouts:
            raise ConfigError("'val.prompts' is set, but greedy answers are scored by an RL run")
        prompts = load_prompts(val.prompts, tokenizer)
        reward_fn = reward_function(config.rollout.reward)
    environment, environment_name = None, ""
    if held_out:
        environment, environment_name = environment_of(config.rollout)
        prompts, _, _ = source_prompts(
            environment.prompt_sources("val"),
            tokenizer,
            environment.start,
            f"the held-out prompts of {environment_name}",
        )
    return EvalData(
        corpus=corpus,
        rows=pack_in_order([corpus.length(i) for i in range(corpus.num_samples)], config.seq_len)
        if corpus is not None
        else (),
        prompts=prompts,
        reward_fn=reward_fn,
        tokenizer=tokenizer,
        pad_token_id=pad_token_id(tokenizer),
        environment=environment,
        environment_name=environment_name,
    )


def pack_in_order(lengths: Sequence[int], seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Sample ids 0..n-1 packed greedily in order into rows of at most seq_len tokens: a sample
    that does not fit the current row starts the next one. Samples of length 0 (dropped) are
    left out. Pure."""
    rows: list[tuple[int, ...]] = []
    row: list[int] = []
    filled = 0
    for sample_id, length in enumerate(lengths):
        if length > seq_len:
            raise ValueError(f"sample {sample_id} has {length} tokens, more than seq_len={seq_len}")
        if length == 0:
            continue
        if filled + length > seq_len:
            rows.append(tuple(row))
            row, filled = [], 0
        row.append(sample_id)
        filled += length
    if row:
        rows.append(tuple(row))
    return tuple(rows)


def rank_rows(
    rows: Sequence[tuple[int, ...]], dp_rank: int, dp_size: int, micro_batch_size: int
) -> tuple[tuple[int, ...], ...]:
    """This rank's contiguous share of the rows, after empty rows are appended to make every
    rank's share the same whole number of micro-batches: under FSDP2 every rank must run the
    same number of forward passes. An empty row is all padding and has no loss token. Pure."""
    per_pass = dp_size * micro_batch_size
    padded = [*rows, *[()] * (-len(rows) % per_pass)]
    return rank_share(padded, dp_rank, dp_size, what="val rows")


def loss_metrics(loss_sum: float, num_tokens: float) -> dict[str, float]:
    """loss, perplexity and num_tokens (unprefixed) from the summed cross entropy. Pure."""
    loss = loss_sum / num_tokens if num_tokens else math.nan
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return {"loss": loss, "perplexity": perplexity, "num_tokens": num_tokens}


class EvalMode:
    """The model in eval mode inside the block, in its former mode after it."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.was_training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)


@torch.no_grad()
def eval_loss_sums(
    model: nn.Module,
    data: EvalData,
    runtime: Runtime,
    *,
    seq_len: int,
    micro_batch_size: int,
    chunk_tokens: int,
) -> tuple[float, float]:
    """(summed cross entropy, loss-token count) of all val rows over all ranks (an all-reduce)."""
    if data.corpus is None:
        raise ValueError("eval_loss_sums needs val.sources")
    rows = rank_rows(data.rows, runtime.dp_rank, runtime.dims.dp, micro_batch_size)
    sums = torch.zeros(2, dtype=torch.float64, device=runtime.device)
    with EvalMode(model):
        for i in range(0, len(rows), micro_batch_size):
            packed = pack_rows(
                [[data.corpus.tokens(s) for s in row] for row in rows[i : i + micro_batch_size]],
                seq_len=seq_len,
                pad_token_id=data.pad_token_id,
            )
            packed = to_device(packed, runtime.device)
            tokens = loss_tokens_of(packed)
            _, logprobs = forward_loss_tokens(model, packed, tokens, chunk_tokens)
            sums[0] -= logprobs.logp.double().sum()
            sums[1] += tokens.targets.numel()
    loss_sum, num_tokens = all_reduce_sum(sums, runtime.distributed).tolist()
    return loss_sum, num_tokens


def greedy_answers(
    model: nn.Module,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    stop_token_ids: Collection[int],
) -> list[tuple[int, ...]]:
    """The greedy answer's token ids to each prompt, all prompts decoded in one batch: the one
    place validation generates."""
    if not prompts:
        return []
    groups = generate(
        model,
        [prompt.token_ids for prompt in prompts],
        num_samples=1,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        greedy=True,
    )
    return [completions[0].token_ids for completions in groups]


def eval_reward_sums(
    engine: Any, policy: nn.Module, data: EvalData, runtime: Runtime, config: RLConfig
) -> tuple[float, float, dict[str, list[float]]]:
    """(summed reward, prompt count, named rewards' name -> [count, sum]) of the greedy answers
    to all val prompts over all ranks.

    The engine's inference copy is synced with the policy first (every rank, a collective under
    FSDP2); rank r answers prompts r, r + dp, ..., so no rank idles when the count is uneven.
    Held-out prompts of an environment are scored by its `score` on the one-turn conversation
    (its named rewards too); val.prompts by rollout.reward. A NaN or infinite reward follows
    rollout.on_bad_reward, as in training: "error" stops the run naming the prompt, "skip"
    leaves that prompt out of the mean.
    """
    engine.sync_weights_(policy)
    mine = data.prompts[runtime.dp_rank :: runtime.dims.dp]
    answers = greedy_answers(
        engine.model,
        mine,
        max_new_tokens=config.rollout.max_new_tokens,
        stop_token_ids=engine.stop_token_ids,
    )
    total, count = 0.0, 0
    kept: list[Scored] = []
    for prompt, ids in zip(mine, answers):
        message = held_out_message(prompt, ids, data, config, engine.stop_token_ids)
        scored, name, where = held_out_score(prompt, message, data, config)
        if keep_group([scored.reward], config.rollout.on_bad_reward, where, name):
            total, count = total + scored.reward, count + 1
            kept.append(scored)
    sums = torch.tensor([total, float(count)], dtype=torch.float64, device=runtime.device)
    reward_sum, count = all_reduce_sum(sums, runtime.distributed).tolist()
    named = named_sums(part for scored in kept for part in scored.named)
    return reward_sum, count, all_ranks_named_sums(named, runtime)


def held_out_message(
    prompt: Prompt,
    ids: Sequence[int],
    data: EvalData,
    config: RLConfig,
    stop_token_ids: Collection[int],
) -> dict[str, Any]:
    """The assistant message of the greedy answer `ids`, read as a training episode reads its
    turns (fnt.rollout.environments.parsers.read_turn: the model family's reasoning and tool
    formats, special tokens kept unless the environment asks otherwise), so a held-out reward
    scores the same text a training reward would."""
    rollout = config.rollout
    return read_turn(
        data.tokenizer,
        turn_parser(data.tokenizer.chat_template, rollout.tool_parser, rollout.reasoning_parser),
        ids,
        stopped=bool(ids) and ids[-1] in stop_token_ids,
        context_ids=prompt.token_ids,
        tools=prompt.tools,
        keep_special_tokens=getattr(data.environment, "keep_special_tokens", True),
    )


def held_out_score(
    prompt: Prompt, message: dict[str, Any], data: EvalData, config: RLConfig
) -> tuple[Scored, str, str]:
    """The reward of the greedy answer's assistant `message` to a val prompt (rollout.reward
    scores its content, as in training), the name of what scored it and where the prompt is
    (for messages)."""
    if data.environment is None:
        name = config.rollout.reward
        where = f"line {prompt.line} of val.prompts ({config.val.prompts})"
        text = message["content"]
        return Scored(score([text], prompt.record, data.reward_fn, name, where)[0]), name, where
    name = data.environment_name
    where = f"held-out prompt {prompt.line} of {name}"
    messages = [*prompt.messages, message]
    try:
        value = data.environment.score(prompt.record, messages)
    except Exception as e:
        raise ValueError(f"{name} failed on {where}: {e}") from e
    weights = getattr(data.environment, "reward_weights", None) or {}
    return weighted_reward(value, weights, name, where), name, where
