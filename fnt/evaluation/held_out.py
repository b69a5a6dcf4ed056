"""The held-out samples and prompts of an SFT or RL run (the `[val]` section): the token-weighted
loss on held-out samples (`val.sources`) and, in RL, the mean reward of greedy episodes of
held-out prompts (`val.prompts`, or the environment's own), over all ranks. `EvalData` is the
state's `val` handle (an Evaluator).
Side effects: `load_eval_data` reads the val sources and prompts (init_state calls it before
the model loads, so a bad file fails first). An evaluation (`EvalData.evaluate`) runs forward
passes of the model without gradients, in eval mode and then back in the mode it was in; it
generates on the rollout engine's inference copy (fnt.config.engines: an engine with
`greedy_eval`) after loading the policy's weights into it (a collective under FSDP2); and it
all-reduces its sums. Every rank evaluates its share (rows of samples, prompts), and all ranks
finish an evaluation together, in that all-reduce. Nothing an evaluation does reaches training:
no gradient, no optimizer state, no generator of training's is drawn from (greedy decoding draws
nothing; val.samples draws from generators of its own), and the data position stays where it is.

A multi-turn environment's held-out episodes run to their end, as training's do
(fnt.rollout.environments.episodes.run_episodes under training's rules: rollout.max_turns,
max_new_tokens, max_episode_tokens, the turn parsers), every turn of all episodes one greedy
batch, and the environment's `score` of the whole episode is val/reward/mean. A single-turn run
(rollout.reward, or rollout.max_turns = 1) scores the one greedy answer, as it always has.
rollout.on_truncated = "zero" scores a truncated held-out episode 0; "score" and "drop" score it
as it is (a held-out mean that left failures out would flatter the model).

`val.samples = k` adds k episodes per held-out prompt sampled at rollout.temperature, each
prompt's from generators of its own seeded by (seed, step, the prompt's index, episode, turn)
under a "val/" key of their own (`val_seed`), so the samples depend on neither the number of
ranks nor a resume, and training's draws are untouched: val/reward/avg@k is the mean reward
of all k * prompts samples, val/reward/pass@k the share of prompts with at least one sample of
reward >= 1 (`PASS_REWARD`: fnt's task rewards are 1 for a fully right answer, and a
similarity or partial credit near 1 is not a pass). With n = k samples, the unbiased pass@k
estimator of Chen et al. 2021 (1 - C(n - c, k) / C(n, k)) is exactly "any of the k passed".

Whole episodes also give turns/mean and tool_calls/mean, the model turns and tool calls per
greedy episode. A mixture's (rollout.environments) held-out prompts are its members' (an
entry's val_prompts, or a built-in's own), and each member with some is validated on its own
(`member_eval_data`: its prompts run by its environment, through the mixture's dispatch, with
messages that name its entry): {name}/reward/mean, {name}/reward/avg@k and {name}/reward/pass@k
per member, beside the overall keys over all held-out prompts (each prompt weighs the same).

Which rows get which keys is fnt.evaluation's `Evaluation` (the driver's side of evaluation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Collection, NamedTuple, Optional, Sequence

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
from fnt.rollout.base import (
    all_ranks_named_sums,
    merge_named_sums,
    named_reward_means,
    named_sums,
)
from fnt.rollout.environments import environment_of
from fnt.rollout.environments.episodes import (
    Episode,
    EpisodeRules,
    run_episodes,
    score_episode,
)
from fnt.rollout.environments.mixture import MixtureEnvironment, member_name
from fnt.rollout.environments.parsers import read_turn, turn_parser
from fnt.rollout.environments.protocol import Scored, weighted_reward
from fnt.rollout.environments.single_turn import SingleTurnEnvironment
from fnt.rollout.prompts import Prompt, load_prompts, source_prompts
from fnt.rollout.rewards import RewardFn, keep_group, reward_function, score
from fnt.rollout.sampling import Completion, generate
from fnt.state import Stateless, TrainState
from fnt.update import forward_loss_tokens


class HeldOutSums(NamedTuple):
    """The greedy answers' or episodes' sums over all ranks (`greedy_reward_sums`,
    `greedy_episode_sums`), over the episodes rollout.on_bad_reward keeps."""

    reward_sum: float
    count: float
    """Episodes scored (one per held-out prompt, less those left out as bad rewards)."""
    named: dict[str, list[float]]
    """Named rewards: name -> [count, sum]."""
    turns: float = 0.0
    """Model turns of those episodes (the one-turn path: one each)."""
    tool_calls: float = 0.0
    """Tool calls those episodes ran (the one-turn path runs none)."""


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
    rules: Optional[EpisodeRules] = None
    """The rules held-out episodes run by (training's, one episode per prompt); None without
    prompts."""
    whole_episodes: bool = False
    """The greedy episodes run to their end (a multi-turn environment); else one turn."""
    slots: tuple[int, ...] = ()
    """Each prompt's index among all the run's held-out prompts, which seeds its sampled
    episodes (`val_seed`); empty: its index in `prompts`."""
    members: tuple[tuple[str, "EvalData"], ...] = ()
    """A mixture's (rollout.environments) members that have held-out prompts, in config order,
    each with the EvalData of its own prompts (`member_eval_data`); empty: no mixture."""

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
            handles.rollouts.sync_weights_(handles.model)
            # A mixture's members are validated one after the other, each on its own prompts;
            # the overall keys add up their sums (every held-out prompt weighs the same).
            parts = [
                (name, part.prompt_sums(state)) for name, part in self.members or (("", self),)
            ]
            metrics.update(self.prompt_metrics(config, [sums for _, sums in parts]))
            for name, sums in parts if self.members else ():
                member = self.prompt_metrics(config, [sums], named=False, per_episode=False)
                metrics.update({f"{name}/{key}": value for key, value in member.items()})
        return metrics

    def prompt_sums(self, state: TrainState) -> tuple[HeldOutSums, Optional[tuple]]:
        """The greedy sums of this data's prompts over all ranks, and with val.samples the
        sampled ones (`sampled_episode_sums`); every rank calls it at the same point."""
        config, engine, runtime = state.config, state.handles.rollouts, state.handles.runtime
        greedy_sums = greedy_episode_sums if self.whole_episodes else greedy_reward_sums
        greedy = greedy_sums(engine, self, runtime, config)
        sampled = None
        if config.val.samples > 0:
            sampled = sampled_episode_sums(engine, self, runtime, config, state.progress.step)
        return greedy, sampled

    def prompt_metrics(
        self,
        config: RLConfig,
        parts: Sequence[tuple[HeldOutSums, Optional[tuple]]],
        *,
        named: bool = True,
        per_episode: bool = True,
    ) -> dict[str, float]:
        """reward/mean (with `named`, each named reward's mean; with `per_episode` and
        whole episodes, turns/mean and tool_calls/mean per greedy episode) and with val.samples
        reward/avg@k and reward/pass@k (unprefixed) of the sums of `parts` added up. Pure."""
        reward_sum = sum(greedy.reward_sum for greedy, _ in parts)
        count = sum(greedy.count for greedy, _ in parts)
        metrics = {"reward/mean": reward_sum / count if count else math.nan}
        if named:
            metrics.update(named_reward_means(merge_named_sums(g.named for g, _ in parts)))
        if per_episode and self.whole_episodes:
            for key in ("turns", "tool_calls"):
                total = sum(getattr(greedy, key) for greedy, _ in parts)
                metrics[f"{key}/mean"] = total / count if count else math.nan
        if config.val.samples > 0:
            sampled = [sum(column) for column in zip(*(s for _, s in parts))]
            metrics.update(sampled_metrics(config.val.samples, *sampled))
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
    if val.prompts and not mode_of(config).rollouts:
        raise ConfigError("'val.prompts' is set, but greedy answers are scored by an RL run")
    environment, environment_name = None, ""
    rules, whole_episodes = None, False
    if held_out:
        environment, environment_name = environment_of(config.rollout)
        where = f"the held-out prompts of {environment_name}"
        prompts, _, _ = source_prompts(
            environment.prompt_sources("val"), tokenizer, environment.start, where
        )
    elif val.prompts:
        where = f"val.prompts ({val.prompts})"
        run_environment, run_name = environment_of(config.rollout)
        if isinstance(run_environment, SingleTurnEnvironment):
            prompts = load_prompts(val.prompts, tokenizer)
            reward_fn = reward_function(config.rollout.reward)
        else:
            # The run's environment opens and scores the held-out episodes, as in training.
            environment, environment_name = run_environment, run_name
            prompts = load_prompts(val.prompts, tokenizer, environment.start)
    if prompts:
        episode_environment = environment or SingleTurnEnvironment(reward_fn)
        whole_episodes = config.rollout.max_turns > 1 and not isinstance(
            episode_environment, SingleTurnEnvironment
        )
        rules = held_out_rules(
            config, tokenizer, where, environment_name or f"reward {config.rollout.reward!r}"
        )
    data = EvalData(
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
        rules=rules,
        whole_episodes=whole_episodes,
    )
    if isinstance(environment, MixtureEnvironment) and prompts:
        data = dataclasses.replace(data, members=member_eval_data(data, config))
    return data


def member_eval_data(data: EvalData, config: RLConfig) -> tuple[tuple[str, EvalData], ...]:
    """Each mixture member's share of a mixture's held-out prompts (`data`), in config order,
    those without held-out prompts left out: its prompts, their slots among all of them, and
    rules and messages that name the member (its entry and environment). The mixture stays the
    environment, which hands each record to its member. Pure."""
    assert data.rules is not None
    members = []
    for i, entry in enumerate(config.rollout.environments):
        slots = tuple(s for s, p in enumerate(data.prompts) if member_name(p.record) == entry.name)
        if not slots:
            continue
        key = f"rollout.environments[{i}]"
        name = f"environment {entry.environment!r} ({entry.name!r}, {key})"
        source = f"val_prompts {entry.val_prompts}" if entry.val_prompts else "its own"
        rules = dataclasses.replace(
            data.rules,
            prompts_path=f"the held-out prompts of {entry.name!r} ({key}: {source})",
            name=name,
            reward_name=entry.name,
        )
        prompts = tuple(data.prompts[s] for s in slots)
        member = dataclasses.replace(
            data, prompts=prompts, slots=slots, environment_name=name, rules=rules
        )
        members.append((entry.name, member))
    return tuple(members)


def held_out_rules(config: RLConfig, tokenizer: Any, where: str, name: str) -> EpisodeRules:
    """Training's episode rules (fnt.rollout.base.PromptRollouts) for one episode per held-out
    prompt of `where`, scored by `name`. Pure."""
    rollout = config.rollout
    return EpisodeRules(
        group_size=1,
        max_new_tokens=rollout.max_new_tokens,
        max_turns=rollout.max_turns,
        max_episode_tokens=rollout.max_episode_tokens or config.seq_len,
        on_truncated=rollout.on_truncated,
        on_bad_reward=rollout.on_bad_reward,
        std_normalize=rollout.std_normalize,
        prompts_path=where,
        name=name,
        reward_name=rollout.environment or rollout.reward,
        turn_parser=turn_parser(
            tokenizer.chat_template, rollout.tool_parser, rollout.reasoning_parser
        ),
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


def greedy_reward_sums(
    engine: Any, data: EvalData, runtime: Runtime, config: RLConfig
) -> HeldOutSums:
    """The sums of the greedy answers to all val prompts over all ranks (one turn each).

    The engine's inference copy is already synced with the policy (`EvalData.evaluate`); rank r
    answers prompts r, r + dp, ..., so no rank idles when the count is uneven.
    Held-out prompts of an environment are scored by its `score` on the one-turn conversation
    (its named rewards too); val.prompts by rollout.reward. A NaN or infinite reward follows
    rollout.on_bad_reward, as in training: "error" stops the run naming the prompt, "skip"
    leaves that prompt out of the mean.
    """
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
    return HeldOutSums(reward_sum, count, all_ranks_named_sums(named, runtime), turns=count)


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


PASS_REWARD = 1.0
"""A sampled held-out episode passes (val/reward/pass@k) when its reward is at least this."""


class GreedyTurns:
    """A TurnSampler (fnt.rollout.environments.episodes) that decodes every turn of all
    episodes greedily, in one batch per turn."""

    def __init__(self, model: nn.Module, stop_token_ids: Collection[int]) -> None:
        self.model, self.stop_token_ids = model, stop_token_ids

    def first(self, prompts, num_samples, max_new_tokens) -> list[list[Completion]]:
        return generate(
            self.model,
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            greedy=True,
        )

    def next(self, contexts, max_new_tokens, keys) -> list[Completion]:
        groups = self.first(contexts, 1, list(max_new_tokens))
        return [completions[0] for completions in groups]


def val_seed(seed: int, step: int, slot: int, index: int = 0, turn: int = 1) -> int:
    """A 63-bit generator seed for turn `turn` of sampled held-out episode `index` of held-out
    prompt `slot` (its index among all the held-out prompts), evaluated after `step` updates;
    the first turn's (turn 1) draws all of the prompt's episodes. A key of validation's own, so
    it never repeats a training draw (fnt.rollout.sampling.sampling_seed). Pure."""
    key = f"val/{seed}/{step}/{slot}/{index}/{turn}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


class SampledTurns:
    """A TurnSampler that samples every turn at `temperature`, each prompt's first turn and
    each episode's later turns from generators seeded by `val_seed`; slots[i] is the index among
    all held-out prompts of this call's prompt i."""

    def __init__(
        self,
        model: nn.Module,
        stop_token_ids: Collection[int],
        temperature: float,
        seed: int,
        step: int,
        slots: Sequence[int],
    ) -> None:
        self.model, self.stop_token_ids, self.temperature = model, stop_token_ids, temperature
        self.seed, self.step, self.slots = seed, step, slots
        self.device = next(model.parameters()).device

    def _generate(self, contexts, num_samples, max_new_tokens, seeds) -> list[list[Completion]]:
        return generate(
            self.model,
            contexts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            temperature=self.temperature,
            generators=[torch.Generator(device=self.device).manual_seed(s) for s in seeds],
        )

    def first(self, prompts, num_samples, max_new_tokens) -> list[list[Completion]]:
        seeds = [val_seed(self.seed, self.step, self.slots[i]) for i in range(len(prompts))]
        return self._generate(prompts, num_samples, max_new_tokens, seeds)

    def next(self, contexts, max_new_tokens, keys) -> list[Completion]:
        seeds = [
            val_seed(self.seed, self.step, self.slots[i], index, turn) for i, index, turn in keys
        ]
        return [c for (c,) in self._generate(contexts, 1, list(max_new_tokens), seeds)]


def held_out_episodes(
    sampler: Any, prompts: Sequence[Prompt], data: EvalData, samples: int
) -> list[list[tuple[Episode, Scored]]]:
    """Per prompt, its `samples` episodes run to their end with `sampler` under the held-out
    rules and each scored as training scores it (fnt.rollout.environments.episodes.score_episode;
    rollout.on_truncated = "zero" scores a truncated episode 0)."""
    assert data.rules is not None
    if not prompts:  # a rank with no held-out prompt of a mixture member
        return []
    rules = dataclasses.replace(data.rules, group_size=samples)
    environment = data.environment or SingleTurnEnvironment(data.reward_fn)
    groups = run_episodes(prompts, sampler, environment, data.tokenizer, rules)
    return [
        [
            (
                episode,
                Scored(0.0)
                if episode.truncated and rules.on_truncated == "zero"
                else score_episode(episode, environment, rules),
            )
            for episode in group
        ]
        for group in groups
    ]


def kept_episodes(
    group: Sequence[tuple[Episode, Scored]], data: EvalData, config: RLConfig
) -> list[tuple[Episode, Scored]]:
    """A prompt's scored episodes that rollout.on_bad_reward keeps: "error" stops the run at a
    NaN or infinite reward, naming the prompt and what scored it; "skip" leaves that episode
    out."""
    assert data.rules is not None
    return [
        (episode, scored)
        for episode, scored in group
        if keep_group(
            [scored.reward],
            config.rollout.on_bad_reward,
            episode.where(data.rules),
            data.rules.reward_name,
        )
    ]


def greedy_episode_sums(
    engine: Any, data: EvalData, runtime: Runtime, config: RLConfig
) -> HeldOutSums:
    """`greedy_reward_sums` of whole greedy episodes: each held-out prompt's one episode run to
    its end and scored by the environment on the whole conversation, with its turns and tool
    calls."""
    mine = data.prompts[runtime.dp_rank :: runtime.dims.dp]
    sampler = GreedyTurns(engine.model, engine.stop_token_ids)
    kept = [
        (episode, scored)
        for group in held_out_episodes(sampler, mine, data, 1)
        for episode, scored in kept_episodes(group, data, config)
    ]
    totals = [
        sum(scored.reward for _, scored in kept),
        float(len(kept)),
        float(sum(episode.turns for episode, _ in kept)),
        float(sum(episode.tool_calls for episode, _ in kept)),
    ]
    sums = torch.tensor(totals, dtype=torch.float64, device=runtime.device)
    reward_sum, count, turns, tool_calls = all_reduce_sum(sums, runtime.distributed).tolist()
    named = named_sums(part for _, scored in kept for part in scored.named)
    named = all_ranks_named_sums(named, runtime)
    return HeldOutSums(reward_sum, count, named, turns=turns, tool_calls=tool_calls)


def sampled_episode_sums(
    engine: Any, data: EvalData, runtime: Runtime, config: RLConfig, step: int
) -> tuple[float, float, float, float]:
    """(summed reward, sample count, prompts passed, prompts scored) of val.samples sampled
    episodes per held-out prompt, over all ranks: a prompt is scored when any of its samples is
    kept (rollout.on_bad_reward), and passed when a kept one has reward >= PASS_REWARD."""
    dp_rank, dp_size = runtime.dp_rank, runtime.dims.dp
    mine = data.prompts[dp_rank::dp_size]
    slots = (data.slots or range(len(data.prompts)))[dp_rank::dp_size]
    sampler = SampledTurns(
        engine.model,
        engine.stop_token_ids,
        config.rollout.temperature,
        config.seed,
        step,
        slots,
    )
    totals = [0.0, 0.0, 0.0, 0.0]
    for group in held_out_episodes(sampler, mine, data, config.val.samples):
        rewards = [s.reward for _, s in kept_episodes(group, data, config)]
        if rewards:
            totals[0] += sum(rewards)
            totals[1] += len(rewards)
            totals[2] += float(max(rewards) >= PASS_REWARD)
            totals[3] += 1.0
    sums = torch.tensor(totals, dtype=torch.float64, device=runtime.device)
    reward_sum, count, passed, scored = all_reduce_sum(sums, runtime.distributed).tolist()
    return reward_sum, count, passed, scored


def sampled_metrics(
    k: int, reward_sum: float, count: float, passed: float, prompts: float
) -> dict[str, float]:
    """reward/avg@k and reward/pass@k (unprefixed) from `sampled_episode_sums`. Pure."""
    return {
        f"reward/avg@{k}": reward_sum / count if count else math.nan,
        f"reward/pass@{k}": passed / prompts if prompts else math.nan,
    }
