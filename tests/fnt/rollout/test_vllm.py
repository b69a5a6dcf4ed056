"""The vLLM engine's request building, response parsing, retries and weight loading, against a
fake HTTP server on 127.0.0.1 (the real server's tests are tests/e2e/test_vllm.py)."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fnt.apps.vllm_serve import serve_command
from fnt.config import ConfigError, LoraConfig, RLConfig, RolloutConfig, VLLMConfig, validate
from fnt.errors import DataError, ServerError
from fnt.rollout.engines.vllm import ServerClient, completion_request, parse_completions
from fnt.rollout.publish import published_kind


class FakeServer:
    """An HTTP server whose answers come from `answer(method, path, body) -> (status, json)`;
    it records every request and the client address it came from (with `keep_alive`, an
    HTTP/1.1 server that keeps a connection open for the client's next request)."""

    def __init__(self, answer, keep_alive: bool = False) -> None:
        self.requests: list[tuple[str, str, object]] = []
        self.peers: list[tuple[str, int]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def log_message(self, *args):
                pass

            def reply(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((method, self.path, body))
                fake.peers.append(self.client_address)
                status, payload = answer(method, self.path, body)
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply("GET")

            def do_POST(self):
                self.reply("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(answer, keep_alive=False):
        servers.append(FakeServer(answer, keep_alive))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def unused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens


ROLLOUT = RolloutConfig(group_size=2, max_new_tokens=4, temperature=0.7, vllm=VLLMConfig(top_p=0.9))


def choice(index, ids, logprobs, finish="stop"):
    return {
        "index": index,
        "token_ids": ids,
        "logprobs": {"token_logprobs": logprobs},
        "finish_reason": finish,
    }


def test_a_request_sends_token_ids_and_asks_for_sampled_ids_and_logprobs():
    body = completion_request("m", (5, 6, 7), ROLLOUT, stop_token_ids={9, 3})
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        # Off whatever a server's defaults: the distribution is softmax(logits / T) over the
        # nucleus, which is what the trainer computes (fnt.model.lm_head).
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": [3, 9],
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "ignore_eos": False,
    }


def test_completions_are_parsed_in_index_order_and_stopped_at_a_stop_token():
    response = {
        "choices": [
            choice(1, [4, 4, 4, 4], [-0.5] * 4, finish="length"),
            choice(0, [1, 9], [-0.1, -0.2]),
        ]
    }
    first, second = parse_completions(
        response, n=2, max_new_tokens=4, stop_token_ids={9}, where="req"
    )
    assert first.token_ids == (1, 9) and first.logprobs == (-0.1, -0.2) and first.stopped
    assert second.token_ids == (4, 4, 4, 4) and not second.stopped


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"choices": [choice(0, [1], [-0.1])]}, "expected 2 choices, got 1"),
        ({"error": "x"}, "expected 2 choices, got no"),
        ({"choices": [choice(0, [1], [-0.1]), {"index": 1}]}, "choice 1: no 'token_ids'"),
        (
            {"choices": [choice(0, [1], [-0.1]), {"index": 1, "token_ids": [2]}]},
            "choice 1: 'logprobs.token_logprobs' must give one value per token",
        ),
        (
            {"choices": [choice(0, [1], [-0.1]), choice(1, [1, 2], [-0.1])]},
            "one value per token",
        ),
        (
            {"choices": [choice(0, [1], [-0.1]), choice(1, [1, 2], [-0.1, float("nan")])]},
            "choice 1: token 1's logprob is nan",
        ),
        (
            {"choices": [choice(0, [1], [-0.1]), choice(1, [1], [None])]},
            "token 0's logprob is None",
        ),
        (
            {"choices": [choice(0, [1], [-0.1]), choice(1, [1], [0.5])]},
            "token 0's logprob is 0.5",
        ),
        (
            {"choices": [choice(0, [1], [-0.1]), choice(1, [1] * 5, [-0.1] * 5)]},
            "5 tokens, more than max_tokens = 4",
        ),
    ],
)
def test_a_response_without_valid_ids_or_logprobs_is_rejected_naming_the_request(bad, message):
    with pytest.raises(DataError, match=r"^the request of line 3.*" + message.replace("(", r"\(")):
        parse_completions(
            bad, n=2, max_new_tokens=4, stop_token_ids={9}, where="the request of line 3"
        )


def test_errors_are_retried_with_backoff_until_the_server_answers(fake):
    calls = []

    def answer(method, path, body):
        calls.append(time.monotonic())
        return (503, {"error": "busy"}) if len(calls) < 3 else (200, {"ok": True})

    server = fake(answer)
    client = ServerClient(server.url, timeout_s=5, retry_s=10)
    assert client.call("/v1/completions", {"x": 1}, "sampling") == {"ok": True}
    assert len(calls) == 3
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert gaps[1] > gaps[0] * 1.5  # the wait doubles


def test_a_bad_request_is_not_retried_and_names_the_server(fake):
    server = fake(lambda method, path, body: (400, {"error": "bad seed"}))
    with pytest.raises(ServerError, match=rf"^vLLM server {server.url}: sampling.*HTTP 400.*bad"):
        ServerClient(server.url, timeout_s=5, retry_s=10).call("/v1/completions", {}, "sampling")
    assert len(server.requests) == 1


def test_a_server_that_is_down_fails_after_retry_s_with_one_line_naming_it():
    url = unused_url()
    started = time.monotonic()
    with pytest.raises(ServerError) as error:
        ServerClient(url, timeout_s=5, retry_s=1.0).call("/v1/completions", {}, "sampling")
    elapsed = time.monotonic() - started
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"vLLM server {url}: sampling")
    assert "gave up after" in message and "rollout.vllm.retry_s = 1" in message
    assert 0.5 <= elapsed < 5


def test_a_slow_server_times_out_and_is_retried(fake):
    def answer(method, path, body):
        time.sleep(1.0)
        return 200, {}

    server = fake(answer)
    with pytest.raises(ServerError, match="timed out.*gave up"):
        ServerClient(server.url, timeout_s=0.2, retry_s=0.5).call("/x", {}, "sampling")
    assert len(server.requests) >= 2


def test_the_requests_to_a_server_reuse_one_connection(fake):
    # A multi-turn step sends a request per episode and turn: each must not open a connection.
    server = fake(lambda method, path, body: (200, {"ok": True}), keep_alive=True)
    client = ServerClient(server.url, timeout_s=5, retry_s=0)
    try:
        answers = [client.call("/v1/completions", {"n": i}, "sampling") for i in range(10)]
    finally:
        client.close()
    assert answers == [{"ok": True}] * 10 and [b for *_, b in server.requests] == [
        {"n": i} for i in range(10)
    ]
    assert len(set(server.peers)) == 1, server.peers


def test_startup_waits_for_health_then_names_the_url_and_the_key():
    url = unused_url()
    with pytest.raises(ServerError, match=rf"{url}: not healthy after 1 s.*startup_timeout_s"):
        ServerClient(url, timeout_s=1, retry_s=0).wait_healthy(1)


def weight_server(fake, reported=None):
    version = {"v": None}

    def answer(method, path, body):
        if path == "/update_weight_version":
            version["v"] = body["new_version"]
        if path == "/weight_info":
            return 200, {"weight_version": reported or version["v"]}
        return 200, None

    return fake(answer)


def test_loading_weights_pauses_reloads_drops_the_cache_and_checks_the_version(fake, tmp_path):
    server = weight_server(fake)
    client = ServerClient(server.url, timeout_s=5, retry_s=0)
    client.load_weights(tmp_path / "step_3", 3)
    assert [(m, p) for m, p, _ in server.requests] == [
        ("POST", "/pause?mode=wait"),
        ("POST", "/collective_rpc"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/update_weight_version"),
        ("POST", "/resume"),
        ("GET", "/weight_info"),
    ]
    rpc = server.requests[1][2]
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "step_3")}}
    assert client.version == 3


def test_a_server_that_does_not_take_the_weights_is_an_error(fake, tmp_path):
    server = weight_server(fake, reported="1")
    with pytest.raises(ServerError, match="reports weight version '1'"):
        ServerClient(server.url, timeout_s=5, retry_s=0).load_weights(tmp_path, 3)


def vllm_config(**rollout) -> RLConfig:
    settings = {"engine": "vllm", "prompts": "p.jsonl", "reward": "similarity", **rollout}
    return RLConfig(rollout=RolloutConfig(**settings))


@pytest.mark.parametrize(
    "rollout, message",
    [
        (dict(vllm=VLLMConfig(urls=())), "'rollout.vllm.urls' = \\(\\): name at least one"),
        (dict(vllm=VLLMConfig(urls=("localhost:8000",))), "base URL"),
        (dict(vllm=VLLMConfig(top_p=0.0)), "'rollout.vllm.top_p' = 0.0"),
        (dict(vllm=VLLMConfig(retry_s=-1.0)), "'rollout.vllm.retry_s'"),
        (dict(async_level=2, keep_weights=2), "'rollout.keep_weights' = 2: must be more than"),
        (dict(publish="adapter"), "'rollout.publish' = 'adapter'"),
        (dict(prompts=""), "'rollout.prompts'"),
        (
            dict(async_level=1, keep_weights=2, vllm=VLLMConfig(weight_transfer="nccl")),
            "'rollout.vllm.weight_transfer' = 'nccl': needs rollout.async_level = 0",
        ),
        (dict(vllm=VLLMConfig(nccl_port=65536)), "'rollout.vllm.nccl_port' = 65536"),
    ],
)
def test_bad_vllm_settings_name_the_key(rollout, message):
    config = vllm_config(**rollout)
    if "publish" in rollout:
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, lora=LoraConfig(rank=4))
        )
    with pytest.raises(ConfigError, match=message):
        validate(config, 1)


def test_lora_publishes_merged_weights_for_vllm_and_adapters_for_an_orchestrator():
    lora = dataclasses.replace(RLConfig().model, lora=LoraConfig(rank=4))
    vllm = dataclasses.replace(vllm_config(), model=lora)
    assert published_kind(vllm) == "merged"
    external = dataclasses.replace(vllm, rollout=RolloutConfig(engine="external"))
    assert published_kind(external) == "adapter"
    assert published_kind(vllm_config()) == "full"


def test_the_serve_command_has_the_settings_the_engine_relies_on():
    config = dataclasses.replace(
        vllm_config(vllm=VLLMConfig(urls=("http://10.0.0.5:9001",), kv_cache_gb=2.0)),
        seq_len=512,
        seed=7,
        model=dataclasses.replace(RLConfig().model, name="/models/sft"),
    )
    command, env = serve_command(config, "vllm", cuda=False, extra=("--enforce-eager",))
    line = " ".join(command)
    assert command[:3] == ["vllm", "serve", "/models/sft"]
    for part in (
        "--host 10.0.0.5 --port 9001",
        "--dtype float32",
        "--max-model-len 512",
        "--seed 7",
        "--logprobs-mode processed_logprobs",
        "--generation-config vllm",
    ):
        assert part in line
    assert command[-1] == "--enforce-eager"
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert "--weight-transfer-config" not in command
    command, env = serve_command(config, "vllm", cuda=True)
    assert "--kv-cache-memory-bytes" in command and "VLLM_CPU_KVCACHE_SPACE" not in env
    nccl = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, vllm=VLLMConfig(weight_transfer="nccl"))
    )
    command, _ = serve_command(nccl, "vllm", cuda=True)
    at = command.index("--weight-transfer-config")
    assert json.loads(command[at + 1]) == {"backend": "nccl"}
    no_port = vllm_config(vllm=VLLMConfig(urls=("http://host",)))
    with pytest.raises(ConfigError, match="name the port"):
        serve_command(no_port, "vllm", cuda=False)
    with pytest.raises(ConfigError, match="--index 1"):
        serve_command(config, "vllm", index=1, cuda=False)


FAKE_VLLM = """#!{python}
# A stand-in for the vllm program: records its arguments and environment, answers /health.
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
with open({record!r}, "w") as f:
    json.dump({{"argv": sys.argv[1:], "dev": os.environ.get("VLLM_SERVER_DEV_MODE")}}, f)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
port = int(sys.argv[sys.argv.index("--port") + 1])
HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def serve_config_args(model_dir) -> list[str]:
    model = ["--model.name", str(model_dir)]
    return [*model, "--rollout.prompts", "prompts.jsonl", "--rollout.reward", "similarity"]


def test_a_local_server_is_started_with_fnt_vllm_serve_and_killed_on_exit(tiny_model_dir, tmp_path):
    import sys
    from urllib.parse import urlparse

    from fnt.apps.vllm_serve import local_server

    program, record = tmp_path / "vllm", tmp_path / "argv.json"
    program.write_text(FAKE_VLLM.format(python=sys.executable, record=str(record)))
    program.chmod(0o755)
    log = tmp_path / "server.log"
    args = serve_config_args(tiny_model_dir)
    with local_server(args, log, vllm=str(program), extra=["--enforce-eager"]) as server:
        port = urlparse(server.url).port
        ServerClient(server.url, timeout_s=5, retry_s=0).wait_healthy(5)
        started = json.loads(record.read_text())
    assert started["argv"][:2] == ["serve", str(tiny_model_dir)]
    assert started["argv"][started["argv"].index("--port") + 1] == str(port)
    assert started["argv"][-1] == "--enforce-eager" and started["dev"] == "1"
    assert server.process.poll() is not None  # killed, with its process group
    with pytest.raises(ServerError, match="not healthy"):
        ServerClient(server.url, timeout_s=1, retry_s=0).wait_healthy(0)


def test_a_local_server_that_exits_at_start_up_is_an_error_showing_its_log(
    tiny_model_dir, tmp_path
):
    from fnt.apps.vllm_serve import local_server

    program = tmp_path / "vllm"
    program.write_text("#!/bin/sh\necho 'no CPU support here' >&2\nexit 1\n")
    program.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)exited.*no CPU support here"):
        with local_server(serve_config_args(tiny_model_dir), tmp_path / "log", vllm=str(program)):
            pass


def test_nccl_weight_transfer_without_cuda_is_a_config_error_naming_the_key(monkeypatch):
    import torch

    from fnt.rollout.engines.vllm_nccl import NcclWeightSender

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'rollout.vllm.weight_transfer' = 'nccl'.*no CUDA"):
        NcclWeightSender(vllm_config(vllm=VLLMConfig(weight_transfer="nccl")))
