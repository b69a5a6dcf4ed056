"""The vLLM engine under nucleus sampling (rollout.vllm.top_p < 1), against a fake server that
samples as vLLM does: each token drawn from the tiny policy's softmax(logits / T) over the
nucleus of the request's top_p (the float64 rule of tests/steps/test_nucleus.py), returned with
its logprob in that truncated distribution (vLLM's processed_logprobs). The engine's micro-batches
carry the top-p, so the RL step's sampler/trainer mismatch is nil; over the full softmax it
would not be. The real server's test is tests/e2e/test_vllm.py."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.config import VLLMConfig
from fnt.rollout.engines.vllm import VLLMEngine
from steps.rl import rl_gradients_, rl_metrics
from tests.steps.test_nucleus import reference_nucleus

from .conftest import rl_config, rl_state
from .test_vllm import FakeServer


class NucleusServer:
    """/v1/completions of a vLLM server that samples from the model in `model_dir` with each
    request's temperature and top_p (seeded per request and choice); the weight-loading
    endpoints answer as a server's do. Records the completion requests' bodies."""

    def __init__(self, model_dir) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.version = None

    def complete(self, body: dict, seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        prompt = list(body["prompt"])
        ids, logprobs = [], []
        for _ in range(body["max_tokens"]):
            with torch.no_grad():
                logits = self.model(torch.tensor([prompt + ids])).logits[0, -1].float()
            z = logits / body["temperature"]  # float32, as vLLM's sampler divides
            keep = torch.zeros(z.shape, dtype=torch.bool)
            keep[list(reference_nucleus(z.tolist(), body["top_p"], int(z.argmax())))] = True
            logq = z.double().masked_fill(~keep, -math.inf).log_softmax(-1)
            token = int(torch.multinomial(logq.exp(), 1, generator=gen))
            ids.append(token)
            logprobs.append(float(logq[token]))
            if token in body["stop_token_ids"]:
                break
        return {"token_ids": ids, "logprobs": {"token_logprobs": logprobs}}

    def answer(self, method, path, body):
        if path == "/v1/models":
            return 200, {"data": [{"id": "nucleus"}]}
        if path == "/update_weight_version":
            self.version = body["new_version"]
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path != "/v1/completions":
            return 200, None
        with self.lock:  # one request at a time through the model
            self.bodies.append(body)
            seed = 1000 * len(self.bodies)
            choices = [{"index": i, **self.complete(body, seed + i)} for i in range(body["n"])]
        return 200, {"choices": choices}


@pytest.fixture
def nucleus_server(policy_dir):
    script = NucleusServer(policy_dir)
    server = FakeServer(script.answer)
    yield script, server
    server.close()


@pytest.mark.parametrize("top_p", [0.7, 1.0])
def test_under_top_p_the_trainer_compares_the_servers_logprobs_with_its_own_nucleus(
    policy_dir, prompts_file, nucleus_server, tmp_path, top_p
):
    script, server = nucleus_server
    config = rl_config(
        policy_dir,
        prompts_file,
        engine="vllm",
        vllm=VLLMConfig(urls=(server.url,), retry_s=0.0, top_p=top_p),
    )
    config = dataclasses.replace(config, output_dir=str(tmp_path))
    state = rl_state(config)
    engine = state.handles.rollouts
    assert isinstance(engine, VLLMEngine)
    try:
        engine.publish_(state)  # what the driver does before it asks for the rollouts
        batch = engine.rollout(state)
    finally:
        engine.close()

    assert script.bodies and all(b["top_p"] == top_p and b["top_k"] == 0 for b in script.bodies)
    for mb in batch.micro_batches:
        if top_p < 1:
            assert mb.top_ps is not None and (mb.top_ps == top_p).all()
        else:  # exactly the batch of before: the trainer's full softmax, bit for bit
            assert mb.top_ps is None

    def mismatch(b):
        totals = rl_gradients_(state.handles.model, b, state.handles.runtime, config.loss, 16)
        state.handles.model.zero_grad(set_to_none=True)
        return float(rl_metrics(totals, with_inference=True)["mismatch_kl/all/mean"])

    # The sampler's and the trainer's logprobs of the same tokens, both over the nucleus.
    assert mismatch(batch) < 1e-9
    if top_p < 1:
        full_softmax = dataclasses.replace(
            batch,
            micro_batches=tuple(dataclasses.replace(mb, top_ps=None) for mb in batch.micro_batches),
        )
        assert mismatch(full_softmax) > 1e-2  # what comparing unlike with unlike costs
