"""Reward functions: built-ins by name, user functions as `module:function`, and a bounded
thread pool that scores a batch.

Every reward function has the signature

    fn(prompt: str, response: str, answer: str) -> float

`prompt` is the prompt as given in the data (before the chat template), `response` the decoded
completion (special tokens removed), `answer` the data's reference answer. A function that
raises, or returns something that is not a finite number, scores 0 for that sample; the
failures are counted and returned, never hidden.

Built-ins:
* `math`: `math-verify` equivalence of the response's final answer (a `\\boxed{}` expression or
  the last number / expression) with the reference; a GSM8K-style reference `"... #### 72"`
  is reduced to the text after the last `####`.
* `exact_match`: the response equals the answer after stripping and collapsing whitespace.
* `arith`: the synthetic arithmetic task's checker (`tasks/arith.py`).
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from miles_like.schema import RecipeError, closest
from miles_like.tasks import arith

RewardFn = Callable[[str, str, str], float]
SPEC_FIELD = "reward.function"


def exact_match(prompt: str, response: str, answer: str) -> float:
    return 1.0 if " ".join(response.split()) == " ".join(answer.split()) else 0.0


def arith_reward(prompt: str, response: str, answer: str) -> float:
    return arith.score(response, answer)


def math_reward(prompt: str, response: str, answer: str) -> float:
    # Imported here: math-verify pulls in sympy (about a second) and only this reward needs it.
    from math_verify import parse, verify

    # The timeouts of math-verify use SIGALRM, which only works on the main thread; we score on
    # a pool, so they are off (parsing is bounded by the response length).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    gold = parse(answer.strip(), parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match,
    "arith": arith_reward,
}

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_SPEC_RE = re.compile(rf"(?P<module>{_DOTTED}):(?P<function>{_DOTTED})")


def check_spec(spec: str) -> None:
    """The spec is a built-in name or has the `module:function` form (nothing imported)."""
    if spec in BUILTIN_REWARDS or _SPEC_RE.fullmatch(spec):
        return
    near = closest(spec, list(BUILTIN_REWARDS)) if ":" not in spec else None
    if near is not None:
        raise RecipeError(f"{SPEC_FIELD}={spec!r} is not a built-in; did you mean {near}?")
    raise RecipeError(f"{SPEC_FIELD}={spec!r}: use a built-in ({' | '.join(BUILTIN_REWARDS)}) "
                      "or module:function, e.g. my_rewards:score")


def resolve_reward(spec: str) -> RewardFn:
    """The function a spec names; a user module is imported (it must be on sys.path)."""
    check_spec(spec)
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    m = _SPEC_RE.fullmatch(spec)
    module_name, attr = m.group("module"), m.group("function")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RecipeError(f"{SPEC_FIELD}={spec!r}: cannot import module {e.name!r}; put it on "
                          "PYTHONPATH or fix the name") from None
    except Exception as e:  # the user's module failed while importing
        raise RecipeError(f"{SPEC_FIELD}={spec!r}: importing {module_name!r} raised "
                          f"{type(e).__name__}: {e}; fix that module") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RecipeError(f"{SPEC_FIELD}={spec!r}: module {module_name!r} has no {attr!r}; "
                              "fix the function name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RecipeError(f"{SPEC_FIELD}={spec!r}: {attr!r} is not callable; name a function "
                          "fn(prompt, response, answer) -> float")
    return obj


class RewardResult(NamedTuple):
    scores: list[float]   # one per sample, in input order; 0.0 where the function failed
    num_errors: int       # calls that raised (or returned something not a number)
    num_nan: int          # calls that returned NaN or +-inf


def score_one(fn: RewardFn, prompt: str, response: str, answer: str) -> tuple[float, str]:
    try:
        value = float(fn(prompt, response, answer))
    except Exception:  # a user function's failure is a sample's score of 0, counted
        return 0.0, "error"
    if not math.isfinite(value):
        return 0.0, "nan"
    return value, "ok"


def compute_rewards(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    answers: Sequence[str], max_workers: int = 8) -> RewardResult:
    """Score every (prompt, response, answer) with at most `max_workers` threads at once."""
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"compute_rewards: {len(prompts)} prompts, {len(responses)} responses, "
                         f"{len(answers)} answers; give one of each per sample")
    if max_workers < 1:
        raise ValueError(f"compute_rewards: max_workers={max_workers}; use >= 1")
    if not prompts:
        return RewardResult([], 0, 0)
    with ThreadPoolExecutor(max_workers=min(max_workers, len(prompts))) as pool:
        results = list(pool.map(lambda args: score_one(fn, *args),
                                zip(prompts, responses, answers)))
    return RewardResult(scores=[v for v, _ in results],
                        num_errors=sum(status == "error" for _, status in results),
                        num_nan=sum(status == "nan" for _, status in results))
