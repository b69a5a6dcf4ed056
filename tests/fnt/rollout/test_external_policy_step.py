"""The external protocol's policy step: rollouts older than rollout.async_level allows are never
used; the trainer waits for them to be replaced."""

from __future__ import annotations

import threading

import pytest

from fnt.errors import DataError
from fnt.rollout.engines.external import RolloutTimeout, wait_for_fresh_rollouts
from fnt.store.transaction import begin_dir_, commit_dir_


def write_rollouts(path, policy_step=None) -> None:
    partial = begin_dir_(path)
    (partial / "samples.jsonl").write_text("")
    if policy_step is not None:
        (partial / "policy_step").write_text(f"{policy_step}\n")
    commit_dir_(partial, path, replace=True)


def test_rollouts_without_a_policy_step_count_as_on_policy(tmp_path):
    write_rollouts(tmp_path / "step_5")
    assert wait_for_fresh_rollouts(tmp_path / "step_5", 5, 0, timeout_s=1) == 4


@pytest.mark.parametrize(("policy_step", "async_level"), [(4, 0), (3, 1), (2, 2), (4, 2)])
def test_rollouts_as_fresh_as_the_async_level_allows_are_used(tmp_path, policy_step, async_level):
    write_rollouts(tmp_path / "step_5", policy_step)
    assert wait_for_fresh_rollouts(tmp_path / "step_5", 5, async_level, 1) == policy_step


def test_older_rollouts_are_waited_past_until_replaced(tmp_path):
    path = tmp_path / "step_5"
    write_rollouts(path, 2)
    with pytest.raises(RolloutTimeout, match="policy step 2, older than the 3 that"):
        wait_for_fresh_rollouts(path, 5, 1, timeout_s=0.2)
    replace = threading.Timer(0.2, write_rollouts, (path, 3))
    replace.start()
    try:
        assert wait_for_fresh_rollouts(path, 5, 1, timeout_s=5) == 3
    finally:
        replace.join()


@pytest.mark.parametrize(("text", "message"), [("5", "policy step 5, but"), ("x", "integer")])
def test_a_policy_step_from_the_future_or_not_a_number_is_a_data_error(tmp_path, text, message):
    write_rollouts(tmp_path / "step_5")
    (tmp_path / "step_5" / "policy_step").write_text(text)
    with pytest.raises(DataError, match=message):
        wait_for_fresh_rollouts(tmp_path / "step_5", 5, 1, timeout_s=1)


def test_a_directory_read_while_it_is_being_replaced_is_waited_for_again(tmp_path, monkeypatch):
    # The orchestrator's replacement removes the marker, then the files, then renames the new
    # directory in; a policy_step read in between (gone: "on-policy") must not be believed.
    from fnt.rollout.engines import external

    path = tmp_path / "step_5"
    write_rollouts(path, 2)
    real_read = external.read_policy_step
    replacing = []

    def read_during_the_replacement(at):
        if not replacing:
            (at / "COMPLETE").unlink()
            (at / "policy_step").unlink()
            replacing.append(threading.Timer(0.2, write_rollouts, (path, 3)))
            replacing[0].start()
        return real_read(at)

    monkeypatch.setattr(external, "read_policy_step", read_during_the_replacement)
    try:
        assert wait_for_fresh_rollouts(path, 5, 1, timeout_s=5) == 3
    finally:
        replacing[0].join()
