"""fnt.rollout.user_code: a user's failing function as one line and the user's own frames."""

from __future__ import annotations

import pytest

from fnt.errors import UserCodeError
from fnt.rollout.rewards import score
from fnt.rollout.user_code import FNT_DIRS, UserCodeRaised, call_user, is_users, raised


def users_reward(completion, sample):
    return helper(completion)


def helper(completion):
    raise ValueError(f"cannot read\n{completion!r}")


def test_a_raise_is_one_line_then_only_the_users_frames():
    with pytest.raises(UserCodeRaised) as caught:
        # Through fnt's own score(): its frames must not show, the two of this file must.
        score(["a"], {"prompt": "p"}, users_reward, "mine", "the prompt of line 3 of p.jsonl")
    first, *frames = str(caught.value).splitlines()
    assert first == (
        "reward 'mine' failed on the prompt of line 3 of p.jsonl (completion 'a'): "
        "ValueError: cannot read 'a'"
    )
    files = [line for line in frames if line.lstrip().startswith("File ")]
    assert len(files) == 2 and all(__file__ in line for line in files)
    assert "in users_reward" in files[0] and "in helper" in files[1]
    assert not any(str(FNT_DIRS[0]) in line for line in frames)


def test_frames_of_fnt_and_of_python_are_not_the_users():
    import json

    import fnt.rollout.rewards

    assert is_users(__file__)
    assert not is_users(fnt.rollout.rewards.__file__)
    assert not is_users(json.__file__)


def test_a_told_error_passes_as_it_is_and_a_raise_without_user_frames_is_one_line():
    told = UserCodeError("already told")
    with pytest.raises(UserCodeError) as caught:
        call_user(lambda: (_ for _ in ()).throw(told), "x failed")
    assert caught.value is told
    assert str(raised("x failed", KeyError("k"))) == "x failed: KeyError: 'k'"
