"""Reward built-ins, user functions by `module:function`, and the bounded scoring pool."""

from __future__ import annotations

import threading

import pytest

from miles_like.rewards import (BUILTIN_REWARDS, RecipeError, compute_rewards, exact_match,
                                resolve_reward)


def test_exact_match_normalises_whitespace_only():
    assert exact_match("", "  hello   world\n", "hello world") == 1.0
    assert exact_match("", "Hello world", "hello world") == 0.0
    assert exact_match("", "42.", "42") == 0.0


def test_arith_checker():
    fn = BUILTIN_REWARDS["arith"]
    assert fn("12+30=", "42", "42") == 1.0
    assert fn("12+30=", " 42 ", "42") == 1.0
    assert fn("12+30=", "042", "42") == 1.0   # the same integer
    assert fn("12+30=", "43", "42") == 0.0
    assert fn("12+30=", "42abc", "42") == 0.0
    assert fn("12+30=", "", "42") == 0.0


@pytest.mark.parametrize("response,answer,expected", [
    ("The answer is \\boxed{72}.", "72", 1.0),
    ("so we get $\\frac{1}{2}$", "0.5", 1.0),
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "She sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("The answer is \\boxed{71}.", "72", 0.0),
    ("I do not know", "72", 0.0),
])
def test_math_reward(response, answer, expected):
    assert BUILTIN_REWARDS["math"]("q", response, answer) == expected


def test_user_function_specs():
    assert resolve_reward("user_rewards:length_score")("p", "abc", "x") == 3.0
    assert resolve_reward("user_rewards:Scorers.first_char_match")("p", "4", "42") == 1.0
    assert resolve_reward("math") is BUILTIN_REWARDS["math"]


@pytest.mark.parametrize("spec,needle", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("user_rewards:missing", "has no 'missing'"),
    ("user_rewards:NOT_CALLABLE", "not callable"),
    ("user_rewards", "module:function"),
    ("user rewards:fn", "module:function"),
    ("mathh", "did you mean math?"),
    ("nothing_like_it", "math | exact_match | arith"),
])
def test_bad_specs_name_the_field(spec, needle):
    with pytest.raises(RecipeError) as info:
        resolve_reward(spec)
    assert str(info.value).startswith("reward.function=") and needle in str(info.value)


def test_failures_score_zero_and_are_counted():
    def fn(prompt, response, answer):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "nan":
            return float("nan")
        if response == "inf":
            return float("inf")
        if response == "none":
            return None
        return float(len(response))

    res = compute_rewards(fn, ["p"] * 6, ["ab", "raise", "nan", "abc", "inf", "none"], ["a"] * 6)
    assert res.scores == [2.0, 0.0, 0.0, 3.0, 0.0, 0.0]
    assert (res.num_errors, res.num_nan) == (2, 2)


def test_pool_is_bounded_and_concurrent():
    workers = 3
    barrier = threading.Barrier(workers, timeout=10)  # passes only if 3 calls run at once
    lock, active, peak = threading.Lock(), [0], [0]

    def fn(prompt, response, answer):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            barrier.wait()
        finally:
            with lock:
                active[0] -= 1
        return float(response)

    res = compute_rewards(fn, ["p"] * 9, [str(i) for i in range(9)], ["a"] * 9,
                          max_workers=workers)
    assert res.scores == [float(i) for i in range(9)]  # input order, whatever finished first
    assert res.num_errors == 0 and peak[0] == workers


def test_compute_rewards_input_errors():
    assert compute_rewards(exact_match, [], [], []).scores == []
    with pytest.raises(ValueError, match="one of each"):
        compute_rewards(exact_match, ["p"], [], [])
