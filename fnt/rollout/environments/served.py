"""An environment behind HTTP: the server runs it (in its own process, on its own machine, in a
container), the trainer holds a client. Side effects: the client sends HTTP requests; the
server listens on a port, imports the factory's module and runs the environment (in worker
processes with --workers, fnt.rollout.environments.pooled).

The protocol: JSON over HTTP POST, one path per call of fnt.rollout.environments.protocol,
request body -> response body (status 200):

    /info         {}                         -> {"methods": [...], "reward_weights": {...},
                                                 "keep_special_tokens": bool}
    /start        {"record"}                 -> {"messages": [...], "tools": [...] | null}
    /respond      {"record", "messages"}     -> {"reply": null} (the episode ends) or
                                                {"reply": {"messages", "tool_calls",
                                                           "tool_errors", "history"}}
    /score        {"record", "messages"}     -> {"score": float | {name: float}}
    /score_turns  {"record", "messages"}     -> {"scores": [float, ...]}
    /prompt_sources {"split"}                -> {"sources": [{"name", "records", "weight"}]}

"methods" lists which of score_turns and prompt_sources the environment has. An environment that
raises answers status 500 with {"error": text}: its bug, which stops the run as it would in
process. A failed call that is not the environment's fault (its pooled worker crashed or timed
out) answers 503 with {"failed": text}; the client raises EnvironmentFailed for it, and for a
request that gets no answer within its timeout or cannot connect, so the episode fails
(rollout/env_failures) and the run goes on.

Server: `python -m fnt.rollout.environments.served --factory module:factory --port 8765`
(factory(None) builds the environment: the server has no run config); with `--workers N
--timeout-s S --memory-mb M` each call runs in a pool of N worker processes under those limits,
and the server answers up to N requests at once (one thread each).
Client: a run's config names the server, rollout.environment = "http://host:8765" (`build`,
with rollout.isolation's timeout_s and failure_reward); code may build `ServedEnvironment(url)`.
"""

from __future__ import annotations

import argparse
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from typing import Any, Optional

from fnt.errors import ConfigError
from fnt.rollout.environments.protocol import EnvironmentFailed, PromptSource, Reply, Start

OPTIONAL = ("score_turns", "prompt_sources")


def start_json(start: Start) -> dict[str, Any]:
    return {
        "messages": [dict(m) for m in start.messages],
        "tools": None if start.tools is None else [dict(t) for t in start.tools],
    }


def reply_json(reply: Optional[Reply]) -> Optional[dict[str, Any]]:
    if reply is None:
        return None
    return {
        "messages": [dict(m) for m in reply.messages],
        "tool_calls": reply.tool_calls,
        "tool_errors": reply.tool_errors,
        "history": None if reply.history is None else [dict(m) for m in reply.history],
    }


def reply_of(value: Optional[Mapping[str, Any]]) -> Optional[Reply]:
    if value is None:
        return None
    history = value.get("history")
    return Reply(
        messages=tuple(value["messages"]),
        tool_calls=int(value.get("tool_calls", 0)),
        tool_errors=int(value.get("tool_errors", 0)),
        history=None if history is None else tuple(history),
    )


def answer(environment: Any, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The response body of one request (module docstring); KeyError for an unknown path."""
    if path == "/info":
        return {
            "methods": [m for m in OPTIONAL if callable(getattr(environment, m, None))],
            "reward_weights": dict(getattr(environment, "reward_weights", None) or {}),
            "keep_special_tokens": bool(getattr(environment, "keep_special_tokens", True)),
        }
    if path == "/start":
        return start_json(environment.start(body["record"]))
    if path == "/prompt_sources":
        sources = environment.prompt_sources(body["split"])
        return {
            "sources": [
                {"name": s.name, "records": [dict(r) for r in s.records], "weight": s.weight}
                for s in sources
            ]
        }
    record, messages = body["record"], body["messages"]
    if path == "/respond":
        return {"reply": reply_json(environment.respond(record, messages))}
    if path == "/score":
        value = environment.score(record, messages)
        return {"score": dict(value) if isinstance(value, Mapping) else value}
    if path == "/score_turns":
        return {"scores": list(environment.score_turns(record, messages))}
    raise KeyError(path)


def make_server(environment: Any, host: str, port: int, *, threaded: bool = False) -> HTTPServer:
    """A server of `environment` on host:port (0: any free port, server.server_port): one
    request at a time (calls reach the environment in the order they arrive), or with
    `threaded` one thread per request (for an environment that may be called from several
    threads at once, such as a pool of workers)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                status, result = 200, answer(environment, self.path, body)
            except KeyError as e:
                status, result = 404 if e.args == (self.path,) else 500, {"error": repr(e)}
            except EnvironmentFailed as e:
                status, result = 503, {"failed": str(e)}
            except Exception as e:  # the environment's bug: the client stops the run
                status, result = 500, {"error": f"{type(e).__name__}: {e}"}
            data = json.dumps(result).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per call would flood the server's log

    if threaded:
        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True  # a request hung in the environment does not block exit
        return server
    return HTTPServer((host, port), Handler)


class ServedEnvironment:
    """The client: an environment whose calls are requests to `url` (module docstring), each
    with `timeout_s`; `failure_reward` is what an episode whose call failed is worth."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, failure_reward: float = 0.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.failure_reward = float(failure_reward)
        try:
            info = self.post("/info", {})
        except EnvironmentFailed as e:
            raise RuntimeError(f"the environment server {url!r} did not answer: {e}") from None
        self.reward_weights = info["reward_weights"]
        self.keep_special_tokens = info["keep_special_tokens"]
        for optional in OPTIONAL:
            if optional not in info["methods"]:
                setattr(self, optional, None)  # the engines test callable(getattr(...))

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                detail = json.loads(text)
            except json.JSONDecodeError:
                detail = {"error": text}
            if e.code == 503 and "failed" in detail:
                raise EnvironmentFailed(f"{self.url}{path}: {detail['failed']}") from None
            raise RuntimeError(f"{self.url}{path}: {detail.get('error', text)}") from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as e:
            raise EnvironmentFailed(f"{self.url}{path}: {e}") from None

    def start(self, record: Mapping[str, Any]) -> Start:
        value = self.post("/start", {"record": dict(record)})
        tools = value["tools"]
        return Start(tuple(value["messages"]), None if tools is None else tuple(tools))

    def respond(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        body = {"record": dict(record), "messages": [dict(m) for m in messages]}
        return reply_of(self.post("/respond", body)["reply"])

    def score(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        body = {"record": dict(record), "messages": [dict(m) for m in messages]}
        return self.post("/score", body)["score"]

    def score_turns(self, record: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]):
        body = {"record": dict(record), "messages": [dict(m) for m in messages]}
        return self.post("/score_turns", body)["scores"]

    def prompt_sources(self, split: str) -> list[PromptSource]:
        sources = self.post("/prompt_sources", {"split": split})["sources"]
        return [PromptSource(s["name"], tuple(s["records"]), s["weight"]) for s in sources]


def build(rollout: Any) -> ServedEnvironment:
    """The client of a run whose rollout.environment is a server's URL, each request with
    rollout.isolation.timeout_s; ConfigError (one line, how to start a server) when the server
    does not answer."""
    isolation = rollout.isolation
    try:
        return ServedEnvironment(
            rollout.environment,
            timeout_s=isolation.timeout_s,
            failure_reward=isolation.failure_reward,
        )
    except RuntimeError as e:
        problem = str(e)
    except (ValueError, KeyError, TypeError) as e:  # something answered, not fnt's protocol
        problem = f"it is not an environment server: /info answered {type(e).__name__}: {e}"
    raise ConfigError(
        f"'rollout.environment' = {rollout.environment!r}: {problem} (start one: python -m "
        "fnt.rollout.environments.served --factory module:factory --port PORT)"
    )


def server_environment(args: argparse.Namespace) -> Any:
    """The environment the server runs: factory(None), or a pool of workers building it."""
    if args.workers > 0:
        from fnt.rollout.environments.pooled import PooledEnvironment

        return PooledEnvironment(
            args.factory,
            None,
            workers=args.workers,
            timeout_s=args.timeout_s,
            memory_mb=args.memory_mb,
        )
    from fnt.config.references import import_function

    return import_function(args.factory, 1)(None)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fnt.rollout.environments.served",
        description="Serve an RL environment over HTTP (fnt.rollout.environments.served).",
    )
    parser.add_argument(
        "--factory", required=True, help='"module:factory", called as factory(None)'
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--workers", type=int, default=0, help="worker processes (0: in process)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per call, with --workers")
    parser.add_argument("--memory-mb", type=int, default=0, help="per worker, with --workers")
    args = parser.parse_args(argv)
    try:
        environment = server_environment(args)
    except ValueError as e:
        parser.exit(2, f"error: --factory {args.factory!r} {e}\n")
    server = make_server(environment, args.host, args.port, threaded=args.workers > 0)
    print(f"serving {args.factory} on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
