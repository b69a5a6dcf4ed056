"""Shared fixtures: tiny models written once per test session by `fnt make-tiny-model`."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest


def make_model(out: Path, *extra: str) -> Path:
    """`fnt make-tiny-model --out OUT EXTRA...`, in this process (its files do not depend on the
    process or the machine: fnt.model.tiny_model.portable_init_)."""
    from fnt.model import tiny_model

    with contextlib.redirect_stdout(io.StringIO()):
        tiny_model.main(["--out", str(out), *extra])
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A dense Llama-shaped model (hidden 64, 2 layers) with a byte-level chat tokenizer."""
    return make_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A Qwen3-MoE model (4 experts, top-2) with the same tokenizer."""
    return make_model(tmp_path_factory.mktemp("tiny_moe") / "model", "--moe")


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory) -> Path:
    """The dense tiny model with its LM head tied to the input embedding (`--tie`)."""
    return make_model(tmp_path_factory.mktemp("tiny_tied") / "model", "--tie")


@pytest.fixture(scope="session")
def tiny_reference_dir(tmp_path_factory) -> Path:
    """The dense tiny model's architecture with other random weights (seed 1): a reference
    policy for the RL reference-KL tests."""
    return make_model(tmp_path_factory.mktemp("tiny_reference") / "model", "--seed", "1")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3-0.6B's architecture shrunk (hidden 64, 2 layers, tied embeddings) with the real
    Qwen3 chat template and special tokens (tests/fixtures/chat_templates/qwen3.json)."""
    template = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen3.json"
    sizes = ["--hidden-size", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
    extra = ["--intermediate-size", "192", "--chat-template", str(template)]
    return make_model(tmp_path_factory.mktemp("qwen3") / "model", "--arch", "qwen3", *sizes, *extra)


@pytest.fixture(scope="session")
def policy_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its eos row of lm_head scaled 20x.

    The random tiny model almost never samples eos; scaled, eos becomes likely in some contexts
    and unlikely in others, so completions end at different lengths and some hit max_new_tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 20.0
    out = tmp_path_factory.mktemp("policy") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# Reversal puzzles of 2-6 letters: short prompts, and an "answer" for the similarity reward.
WORDS = ["ab", "cat", "dove", "eagle", "falcon", "go", "hen", "ibis", "jays", "kiwi", "lark"]


def write_prompts(path: Path) -> Path:
    import json

    lines = [
        json.dumps({"prompt": word[::-1], "answer": word, "id": i}) for i, word in enumerate(WORDS)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


# Two-rank jobs -------------------------------------------------------------------------------
#
# A test that needs a two-rank run marks itself `@pytest.mark.two_ranks(job=job)`, where `job` is a
# function of its module: `job(fixture, out) -> {"call": "module:function", "args": [...]}` (and
# optionally "env": variables the launch needs), with `fixture(name)` the value of a
# session-scoped fixture and `out` the job's own directory. The jobs of all collected tests run
# in one torchrun launch (tests/two_ranks.py); the test reads its job's files with
# `two_rank_runs(job)`.


class TwoRankRuns:
    """The output directories of the session's two-rank jobs, checked when asked for."""

    def __init__(self, outputs: dict, launch_output: str) -> None:
        self.outputs, self.launch_output = outputs, launch_output

    def __call__(self, job) -> Path:
        out = self.outputs[job]
        errors = sorted(out.glob("rank*.error"))
        if errors:
            name = job.__qualname__
            raise AssertionError(f"two-rank job {name} failed:\n{errors[0].read_text()}")
        if not all((out / f"rank{rank}.done").is_file() for rank in (0, 1)):
            raise AssertionError(
                f"two-rank job {job.__qualname__} did not finish: the launch ended before it\n"
                f"{self.launch_output[-6000:]}"
            )
        return out


@pytest.fixture(scope="session")
def two_rank_runs(request, tmp_path_factory) -> TwoRankRuns:
    import json

    from tests.e2e.helpers import run_script

    jobs = []
    for item in request.session.items:
        for marker in item.iter_markers("two_ranks"):
            if marker.kwargs["job"] not in jobs:
                jobs.append(marker.kwargs["job"])
    root = tmp_path_factory.mktemp("two_ranks")
    outputs, specs, env = {}, [], {}
    for i, job in enumerate(jobs):
        out = root / f"{i}_{job.__name__}"
        spec = job(request.getfixturevalue, out)
        env.update(spec.pop("env", {}))
        specs.append({"name": job.__qualname__, "out": str(out), **spec})
        outputs[job] = out
    (root / "jobs.json").write_text(json.dumps(specs, indent=1))
    proc = run_script(
        "tests.two_ranks",
        str(root / "jobs.json"),
        module=True,
        nproc=2,
        timeout=900,
        check=False,
        env=env,
    )
    return TwoRankRuns(outputs, proc.stdout + proc.stderr)
