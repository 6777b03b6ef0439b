"""Reward functions: built-ins by name, user functions as `module:function`, and
`compute_rewards`, which scores a batch on worker processes (`reward_pool.py`).

Every reward function has the signature

    fn(prompt: str, response: str, answer: str) -> float

`prompt` is the prompt as given in the data (before the chat template), `response` the decoded
completion (special tokens removed), `answer` the data's reference answer. A function that
raises, crashes its worker, runs past `reward.timeout_s`, or returns something that is not a
finite number within +-1e6 scores 0 for that sample; the failures are counted and returned,
never hidden.

Built-ins:
* `math`: `math-verify` equivalence of the response's final answer (a `\\boxed{}` expression or
  the last number / expression) with the reference; a GSM8K-style reference `"... #### 72"`
  is reduced to the text after the last `####`.
* `exact_match`: the response equals the answer after stripping and collapsing whitespace.
* `arith`: the synthetic arithmetic task's checker (`tasks/arith.py`).
* `chain`: the chain task's checker: the value after the response's last `->` (`tasks/chain.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from config_schema import closest
from miles_like.errors import RecipeError
from miles_like.scoring.reward_pool import RewardResult, shared_pool
from miles_like.tasks import arith, chain
from miles_like.user_code import SPEC_RE, import_spec

RewardFn = Callable[[str, str, str], float]
SPEC_FIELD = "reward.function"


def exact_match(prompt: str, response: str, answer: str) -> float:
    return 1.0 if " ".join(response.split()) == " ".join(answer.split()) else 0.0


def arith_reward(prompt: str, response: str, answer: str) -> float:
    return arith.score(response, answer)


def chain_reward(prompt: str, response: str, answer: str) -> float:
    return chain.score(response, answer)


MATH_VERIFY_TIMEOUT_S = 5  # per parse and per comparison (math-verify's own default)


def math_reward(prompt: str, response: str, answer: str) -> float:
    # Imported here: math-verify pulls in sympy (about a second) and only this reward needs it.
    from math_verify import parse, verify

    # math-verify's own timeouts (SIGALRM) are on: scoring runs on a worker process's main
    # thread (`worker_pool.py`), where they work. They cut a slow parse or comparison short
    # (scored 0) long before the pool's per-call timeout would kill the worker.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    gold = parse(answer.strip(), parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    pred = parse(response, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=MATH_VERIFY_TIMEOUT_S) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match,
    "arith": arith_reward,
    "chain": chain_reward,
}


def check_spec(spec: str) -> None:
    """The spec is a built-in name or has the `module:function` form (nothing imported)."""
    if spec in BUILTIN_REWARDS or SPEC_RE.fullmatch(spec):
        return
    near = closest(spec, list(BUILTIN_REWARDS)) if ":" not in spec else None
    if near is not None:
        raise RecipeError(f"{SPEC_FIELD}={spec!r} is not a built-in; did you mean {near}?")
    raise RecipeError(
        f"{SPEC_FIELD}={spec!r}: use a built-in ({' | '.join(BUILTIN_REWARDS)}) "
        "or module:function, e.g. my_rewards:score"
    )


def resolve_reward(spec: str) -> RewardFn:
    """The function a spec names; a user module is imported (it must be on sys.path)."""
    check_spec(spec)
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    obj = import_spec(spec, SPEC_FIELD)
    if not callable(obj):
        raise RecipeError(
            f"{SPEC_FIELD}={spec!r} is not callable; name a function "
            "fn(prompt, response, answer) -> float"
        )
    return obj


def spec_of(fn: RewardFn) -> str:
    """The name a reward function travels to the worker processes by: its built-in name or
    `module:qualname`, which must resolve back to `fn` itself."""
    for name, builtin in BUILTIN_REWARDS.items():
        if fn is builtin:
            return name
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    spec = f"{module}:{qualname}"
    if module is None or module == "__main__" or not SPEC_RE.fullmatch(spec):
        raise ValueError(
            f"reward function {fn!r} runs in worker processes, which import it by "
            "name: define it at module level in an importable module (not a "
            "closure, lambda or __main__) and name it module:function"
        )
    if resolve_reward(spec) is not fn:
        raise ValueError(
            f"reward function {fn!r}: {spec} names another object (a bound method?); "
            "give a module-level function"
        )
    return spec


# Imported by a worker before it takes calls, so the first call is not charged with it.
_PRELOAD = {"math": "math_verify"}
DEFAULT_TIMEOUT_S = 30.0


def compute_rewards(
    fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[str],
    max_workers: int = 8,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RewardResult:
    """Score every (prompt, response, answer) on a persistent pool of `max_workers` worker
    processes (`reward_pool.py`), each call bounded by `timeout_s`."""
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(
            f"compute_rewards: {len(prompts)} prompts, {len(responses)} responses, "
            f"{len(answers)} answers; give one of each per sample"
        )
    if max_workers < 1:
        raise ValueError(f"compute_rewards: max_workers={max_workers}; use >= 1")
    if not prompts:
        return RewardResult([], 0, 0, 0)
    name = spec_of(fn)
    path = f"{fn.__module__}:{fn.__qualname__}"  # what the workers import (spec_of checked it)
    pool = shared_pool(path, max_workers, timeout_s, _PRELOAD.get(name))
    return pool.score(prompts, responses, answers)
