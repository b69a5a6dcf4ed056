"""The reward registry: built-in rewards, "module:function" names, and the errors for bad names."""

from __future__ import annotations

import pytest

from fnt.errors import ConfigError
from fnt.rollout.rewards import REWARDS, exact_match, require_reward, reward_function, similarity


def length_reward(completion: str, sample: dict) -> float:
    """A reward defined outside fnt, resolved by its "module:function" name."""
    return float(len(completion) + sample["bonus"])


REWARDS_NOT_CALLABLE = 3


def test_similarity_is_the_difflib_ratio_with_the_answer():
    assert similarity("abc", {"answer": "abc"}) == 1.0
    assert similarity("xyz", {"answer": "abc"}) == 0.0
    assert similarity("abcd", {"answer": "abce"}) == pytest.approx(0.75)


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match(" 42\n", {"answer": 42}) == 1.0
    assert exact_match("4 2", {"answer": "42"}) == 0.0


def test_a_reward_without_an_answer_field_names_the_fields_it_got():
    with pytest.raises(ValueError, match=r"'answer'.*\['prompt'\]"):
        similarity("abc", {"prompt": "cba"})


def test_registered_names_resolve_to_their_functions():
    assert set(REWARDS) >= {"similarity", "exact_match"}
    assert reward_function("similarity") is similarity
    assert reward_function("exact_match") is exact_match


def test_module_function_names_are_imported():
    fn = reward_function(f"{__name__}:length_reward")
    assert fn is length_reward
    assert fn("abc", {"bonus": 1}) == 4.0


def test_an_unknown_name_lists_the_registered_rewards_and_suggests_one():
    with pytest.raises(
        ValueError, match=r"unknown reward 'similarty' \(did you mean 'similarity'\?\)"
    ) as e:
        reward_function("similarty")
    assert "exact_match, similarity" in str(e.value)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:missing", "has no attribute 'missing'"),
        (f"{__name__}:REWARDS_NOT_CALLABLE", "is not callable"),
    ],
)
def test_bad_module_function_names_say_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        reward_function(name)


def test_ascii_letters_is_the_share_of_letters():
    assert REWARDS["ascii_letters"]("ab1 ", {}) == 0.5
    assert REWARDS["ascii_letters"]("", {}) == 0.0
    assert REWARDS["ascii_letters"]("é", {}) == 0.0


def test_a_reward_module_that_raises_while_imported_is_a_config_error_naming_the_key(
    tmp_path, monkeypatch
):
    (tmp_path / "broken_reward_module.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        require_reward("broken_reward_module:score")
    assert str(info.value) == (
        "'rollout.reward' = 'broken_reward_module:score': cannot import module "
        "'broken_reward_module': it raised RuntimeError: no GPU here; expected "
        "a reward fn(completion: str, sample: dict) -> float"
    )


def test_require_reward_accepts_what_reward_function_resolves():
    assert require_reward("similarity") is similarity
    assert require_reward(f"{__name__}:length_reward") is length_reward
    with pytest.raises(ConfigError, match=r"^'rollout.reward' = 'similarty': unknown reward"):
        require_reward("similarty")
