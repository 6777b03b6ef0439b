"""Reward built-ins, user functions by `module:function`, and the pool of worker processes that
scores them: each failure mode (hang, crash, raise, NaN, junk, huge output) scores 0, is counted
and takes bounded time."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import psutil
import pytest

from miles_like.scoring import reward_pool
from miles_like.scoring.rewards import (
    BUILTIN_REWARDS,
    RecipeError,
    compute_rewards,
    exact_match,
    resolve_reward,
)
from miles_like.worker_pool import hung_up

import unruly_rewards
import user_rewards


def test_exact_match_normalises_whitespace_only():
    assert exact_match("", "  hello   world\n", "hello world") == 1.0
    assert exact_match("", "Hello world", "hello world") == 0.0
    assert exact_match("", "42.", "42") == 0.0


def test_arith_checker():
    fn = BUILTIN_REWARDS["arith"]
    assert fn("12+30=", "42", "42") == 1.0
    assert fn("12+30=", " 42 ", "42") == 1.0
    assert fn("12+30=", "042", "42") == 1.0  # the same integer
    assert fn("12+30=", "43", "42") == 0.0
    assert fn("12+30=", "42abc", "42") == 0.0
    assert fn("12+30=", "", "42") == 0.0


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("The answer is \\boxed{72}.", "72", 1.0),
        ("so we get $\\frac{1}{2}$", "0.5", 1.0),
        (
            "Natalia sold 48+24 = 72 clips.\n#### 72",
            "She sold 48/2 = 24 clips in May.\n#### 72",
            1.0,
        ),
        ("The answer is \\boxed{71}.", "72", 0.0),
        ("I do not know", "72", 0.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert BUILTIN_REWARDS["math"]("q", response, answer) == expected


def test_user_function_specs():
    assert resolve_reward("user_rewards:length_score")("p", "abc", "x") == 3.0
    assert resolve_reward("user_rewards:Scorers.first_char_match")("p", "4", "42") == 1.0
    assert resolve_reward("math") is BUILTIN_REWARDS["math"]


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("user_rewards:missing", "has no 'missing'"),
        ("user_rewards:NOT_CALLABLE", "not callable"),
        ("user_rewards", "module:function"),
        ("user rewards:fn", "module:function"),
        ("mathh", "did you mean math?"),
        ("nothing_like_it", "math | exact_match | arith"),
    ],
)
def test_bad_specs_name_the_field(spec, needle):
    with pytest.raises(RecipeError) as info:
        resolve_reward(spec)
    assert str(info.value).startswith("reward.function=") and needle in str(info.value)


def misbehaving(responses: list[str], max_workers: int = 2, timeout_s: float = 10.0):
    start = time.monotonic()
    res = compute_rewards(
        unruly_rewards.by_response,
        ["p"] * len(responses),
        responses,
        ["a"] * len(responses),
        max_workers=max_workers,
        timeout_s=timeout_s,
    )
    return res, time.monotonic() - start


def test_raise_nan_and_junk_score_zero_and_are_counted():
    res, _ = misbehaving(
        ["ab", "raise", "nan", "abc", "inf", "none", "string", "sys.exit", "huge_value", "huge_int"]
    )
    assert res.scores == [2.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert (res.num_errors, res.num_nan, res.num_timeouts) == (5, 3, 0)


def test_huge_outputs_stay_in_the_worker():
    """A 64 MiB string and an 8M-element list are not numbers: 0, counted, and only a float
    crosses back (the call takes about as long as building them, not as sending them)."""
    res, seconds = misbehaving(["huge_output", "ab", "huge_list"])
    assert res.scores == [0.0, 2.0, 0.0] and res.num_errors == 2
    assert seconds < 60


def test_a_hanging_reward_is_killed_at_its_timeout_and_its_worker_replaced():
    res, seconds = misbehaving(["hang", "ab", "hang", "abc", "hang"], timeout_s=5.0)
    assert res.scores == [0.0, 2.0, 0.0, 3.0, 0.0]
    assert (res.num_errors, res.num_nan, res.num_timeouts) == (0, 0, 3)
    # three 5 s timeouts on two workers, plus the replacements' start-up: far below the hang
    assert seconds < 120
    after, _ = misbehaving(["abcd"] * 4, timeout_s=5.0)  # the same pool, replaced workers
    assert after.scores == [4.0] * 4


def test_a_reward_that_kills_its_worker_scores_zero():
    res, seconds = misbehaving(["exit", "ab", "segfault", "abc", "exit"])
    assert res.scores == [0.0, 2.0, 0.0, 3.0, 0.0]
    assert (res.num_errors, res.num_nan, res.num_timeouts) == (3, 0, 0)
    assert seconds < 60
    after, _ = misbehaving(["abcd"] * 4)
    assert after.scores == [4.0] * 4


def dead(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until `pid` has exited: a zombie whose threads have all ended, which the pool (its
    parent) can reap. A killed multi-threaded process shows as a zombie while its other threads
    are still being torn down, and until then `waitpid` (so `Process.is_alive`) sees it alive."""
    deadline = time.monotonic() + timeout_s

    def exiting() -> bool:
        try:
            proc = psutil.Process(pid)
            return proc.status() != psutil.STATUS_ZOMBIE or proc.num_threads() > 1
        except psutil.NoSuchProcess:
            return False

    while exiting():
        assert time.monotonic() < deadline, f"{pid} still running"
        time.sleep(0.01)


def test_workers_killed_while_idle_are_replaced():
    """Workers killed from outside between batches (the OOM killer, a stray kill) cost nothing:
    the next batch is scored in full on their replacements."""
    first, _ = misbehaving(["ab", "abc"])
    for pid in reward_pool.current_pool().pids():
        os.kill(pid, signal.SIGKILL)
        dead(pid)
    after, _ = misbehaving(["ab", "abc", "abcd"])
    assert first.scores == [2.0, 3.0] and after.scores == [2.0, 3.0, 4.0]
    assert after.num_errors == 0


def test_a_worker_whose_pipe_closed_while_idle_is_replaced_at_no_calls_expense():
    """A worker process that lives on with its pipe to the pool shut (by user code; or a killed
    worker between its exit and its reaping, the race that made the test above flaky) is
    replaced when found idle, before it is handed a job: the next batch is scored in full.
    Fails if the pool trusts `waitpid` alone."""
    first, _ = misbehaving(["hang_up"], max_workers=1)  # the next call finds this worker again
    (pid,) = reward_pool.current_pool().pids()
    time.sleep(1.5)  # past the hang-up
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # alive, pipe closed
    after, _ = misbehaving(["ab", "abc"], max_workers=1)
    assert first.scores == [7.0] and after.scores == [2.0, 3.0] and after.num_errors == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_idle_pipe_is_hung_up_only_once_its_peer_or_itself_is_closed():
    """The pool's idle check on real pipes: an open, silent pipe can carry a job; one whose
    worker end is gone, or whose pool end the closing pool has shut, cannot (and the check
    does not raise)."""
    ours, theirs = multiprocessing.Pipe(duplex=True)
    assert not hung_up(ours)
    theirs.close()
    assert hung_up(ours)
    ours.close()
    assert hung_up(ours)


def test_scoring_runs_on_a_bounded_pool_of_worker_processes():
    workers = 3
    res = compute_rewards(
        unruly_rewards.pid_after, ["p"] * 9, ["0.3"] * 9, ["a"] * 9, max_workers=workers
    )
    pool_pids = {float(pid) for pid in reward_pool.current_pool().pids()}
    assert len(pool_pids) == workers and os.getpid() not in pool_pids
    assert 2 <= len(set(res.scores)) and set(res.scores) <= pool_pids  # concurrent, bounded
    assert res.num_errors == 0
    again = compute_rewards(
        unruly_rewards.pid_after, ["p"] * 3, ["0"] * 3, ["a"] * 3, max_workers=workers
    )
    assert set(again.scores) <= pool_pids  # the same processes: the pool persists


def test_scores_keep_input_order():
    responses = ["x" * i for i in range(12)]
    res = compute_rewards(
        user_rewards.length_score, ["p"] * 12, responses, ["a"] * 12, max_workers=4
    )
    assert res.scores == [float(i) for i in range(12)]


def test_math_reward_in_the_pool():
    res = compute_rewards(
        BUILTIN_REWARDS["math"],
        ["q"] * 3,
        ["The answer is \\boxed{72}.", "71", "so $\\frac{1}{2}$"],
        ["72", "72", "0.5"],
        max_workers=2,
    )
    assert res.scores == [1.0, 0.0, 1.0] and res.num_errors == 0


def test_functions_that_cannot_travel_by_name_are_refused():
    with pytest.raises(ValueError, match="module level"):
        compute_rewards(lambda p, r, a: 1.0, ["p"], ["r"], ["a"])


def test_compute_rewards_input_errors():
    assert compute_rewards(exact_match, [], [], []).scores == []
    with pytest.raises(ValueError, match="one of each"):
        compute_rewards(exact_match, ["p"], [], [])
