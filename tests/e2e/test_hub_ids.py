"""Hub ids where a model is named (issue 45.6): `model.name = "org/name"` (and loss.ref_model,
dpo.ref_model, `fnt generate --checkpoint`) resolve through huggingface_hub's cache, laid out
here as huggingface_hub lays it out, offline (this machine reaches no Hub). The run records the
snapshot it trained from, a resume keeps it when the branch has moved on, each node resolves
once under torchrun, and an id that cannot be had is one error line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, config_args, run_cli

SFT, DPO = "examples/debug/sft.toml", "examples/debug/dpo.toml"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
REPO_ID = "tiny-org/tiny-model"


def lay_out_snapshot(home: Path, repo_id: str, model_dir: Path, commit: str) -> Path:
    """`model_dir`'s files as snapshot `commit` of `repo_id` in the cache of HF_HOME=`home`,
    refs/main pointing at it: what huggingface_hub writes (models--org--name/, blobs named by
    their hash, the snapshot's files relative symlinks to them). Returns the snapshot."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(model_dir.iterdir()):
        if file.is_file():
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_home(tiny_model_dir, tmp_path, monkeypatch) -> Path:
    """HF_HOME with the tiny model as REPO_ID at COMMIT_A, offline; huggingface_hub read its
    environment when it was imported, so this process's copy of it is pointed there too."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    lay_out_snapshot(home, REPO_ID, tiny_model_dir, COMMIT_A)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def recorded_model(out: Path) -> str:
    return json.loads((out / "config.json").read_text())["model"]["name"]


def test_the_laid_out_cache_is_what_huggingface_hub_reads(hub_home):
    from huggingface_hub import scan_cache_dir

    (repo,) = scan_cache_dir(hub_home / "hub").repos
    assert repo.repo_id == REPO_ID and {r.commit_hash for r in repo.revisions} == {COMMIT_A}
    assert {ref for r in repo.revisions for ref in r.refs} == {"main"}


def test_train_resume_and_generate_from_a_hub_id(hub_home, tiny_model_dir, tmp_path):
    snapshot_a = hub_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots"
    out = tmp_path / "run"
    args = config_args(SFT, REPO_ID, out, "--ckpt.interval", "1")
    run_cli("sft", *args, "--max-steps", "2")
    assert recorded_model(out) == str(snapshot_a / COMMIT_A)
    meta = json.loads((out / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["model_name"] == str(snapshot_a / COMMIT_A)
    # The branch moves on; the resume keeps the snapshot the run started from, a new run
    # takes the new one, and a pinned revision takes its own.
    lay_out_snapshot(hub_home, REPO_ID, tiny_model_dir, COMMIT_B)
    run_cli("sft", *args, "--max-steps", "3", "--resume", "latest")
    assert recorded_model(out) == str(snapshot_a / COMMIT_A)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()] == [1, 2, 3]
    fresh = tmp_path / "fresh"
    run_cli("sft", *config_args(SFT, REPO_ID, fresh, "--max-steps", "1"))
    assert recorded_model(fresh) == str(snapshot_a / COMMIT_B)
    pinned = tmp_path / "pinned"
    run_cli("sft", *config_args(SFT, REPO_ID, pinned, "--max-steps", "1"),
            "--model.revision", COMMIT_A)  # fmt: skip
    assert recorded_model(pinned) == str(snapshot_a / COMMIT_A)
    proc = run_cli("generate", "--checkpoint", REPO_ID, "--prompt", "hi", "--max-new-tokens",
                   "2", "--json")  # fmt: skip
    assert json.loads(proc.stdout)["tokens"] <= 2


def test_a_reference_hub_id_is_resolved_or_one_error_line(hub_home, tiny_model_dir, tmp_path):
    out = tmp_path / "dpo"
    dpo = config_args(DPO, tiny_model_dir, out, "--max-steps", "1")
    run_cli("dpo", *dpo, "--dpo.ref-model", REPO_ID)
    snapshot = f"models--{REPO_ID.replace('/', '--')}/snapshots/{COMMIT_A}"
    assert json.loads((out / "config.json").read_text())["dpo"]["ref_model"].endswith(snapshot)
    missing = tmp_path / "missing"
    proc = run_cli("dpo", *config_args(DPO, tiny_model_dir, missing), "--dpo.ref-model",
                   "tiny-org/absent", check=False)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: 'dpo.ref_model' = 'tiny-org/absent': not a local")
    assert not missing.exists()
    proc = run_cli("generate", "--checkpoint", "tiny-org/absent", "--prompt", "hi", check=False)
    assert proc.stderr.startswith("error: --checkpoint 'tiny-org/absent': not a local directory")


def test_an_id_not_in_the_cache_offline_is_one_line_naming_it(tmp_path):
    # A fresh interpreter, so that huggingface_hub reads HF_HOME and HF_HUB_OFFLINE itself.
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    out = tmp_path / "runs" / "x"
    proc = subprocess.run(
        [sys.executable, "-m", "fnt", "sft", *config_args(SFT, "Qwen/Qwen2.5-0.5B", out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "error: 'model.name' = 'Qwen/Qwen2.5-0.5B' (command line): not a local directory, and "
        "as a Hugging Face Hub id it cannot be had: it is not in the cache "
        f"{tmp_path / 'hf-home' / 'hub'} and HF_HUB_OFFLINE is set"
    ), lines[0]
    assert not (tmp_path / "runs").exists()


def test_each_node_resolves_once_and_its_ranks_take_rank_0s_commit(hub_home):
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RUN_ID": "test-launch", "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
    code = f"from fnt.model.hub import hub_snapshot; print(hub_snapshot({REPO_ID!r}))"

    def rank(local_rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "LOCAL_RANK": str(local_rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    # Rank 1 starts first and waits for rank 0's answer (the commit main is at), then takes
    # that commit from the cache.
    waiting = rank(1)
    time.sleep(1)
    assert waiting.poll() is None, waiting.communicate()
    first = rank(0)
    out0, err0 = first.communicate(timeout=60)
    assert first.returncode == 0, err0
    out1, err1 = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err1
    assert out0.strip() == out1.strip() and out0.strip().endswith(f"snapshots/{COMMIT_A}")
    shutil.rmtree(hub_home / "hub" / ".fnt-resolved")


def test_which_names_are_hub_ids_and_every_model_key_resolves(hub_home, tmp_path, monkeypatch):
    from fnt.apps.hub_models import resolve_hub_models
    from fnt.config import ConfigError, RLConfig, load_config
    from fnt.model.hub import is_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny-model").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("tiny-org/tiny-model")
    assert not is_hub_id("runs/tiny-model")  # there: a local directory, whatever its form
    for name in ("./a/b", "/abs/path", "a/b/c", "../a/b", "~/a/b", "a", "a/.."):
        assert not is_hub_id(name), name
    args = ["--model.name", REPO_ID, "--loss.ref-model", REPO_ID, "--output-dir", "out"]
    config, _ = load_config(args, RLConfig)
    resolved = resolve_hub_models(config)
    snapshot = str(hub_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots")
    assert resolved.model.name == resolved.loss.ref_model == f"{snapshot}/{COMMIT_A}"
    config, _ = load_config([*args, "--model.revision", "v2"], RLConfig)
    with pytest.raises(ConfigError, match=r"^'model.name' = 'tiny-org/tiny-model': .* at revision"):
        resolve_hub_models(config)


# Slow: a torchrun launch (the default suite has the node rule itself, two ranks' environments
# without the launch, in the test above).
@pytest.mark.slow
def test_two_ranks_train_from_a_hub_id(hub_home, tmp_path):
    from tests.e2e.helpers import run_script

    out = tmp_path / "run"
    run_script("fnt", "sft", *config_args(SFT, REPO_ID, out, "--max-steps", "2"), nproc=2,
               module=True, timeout=240)  # fmt: skip
    assert recorded_model(out).endswith(f"snapshots/{COMMIT_A}")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()] == [1, 2]
    (marker,) = (hub_home / "hub" / ".fnt-resolved").iterdir()  # rank 0's answer to rank 1
    assert json.loads(marker.read_text()) == {"commit": COMMIT_A}
