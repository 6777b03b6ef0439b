"""Reward functions on the worker pool (`miles_like/worker_pool.py`): a batch of (prompt,
response, answer) triples scored by one reward function, each call bounded in time.

A reward function is user code run on model output: it may hang (a pathological expression in
sympy), crash its process (a segfault in a C extension, `os._exit`), raise, or return junk. The
pool bounds, replaces and reports the first three; here each becomes a sample scored 0 and
counted: `timeout`, `error` (raised, crashed, or no worker to run it) and `nan` (not finite, or
beyond +-MAX_ABS_REWARD). The worker checks the value itself (`score_value`), so only a float
crosses back: a huge or unpicklable return value never reaches the controller.

The function travels by name, `module:qualname`, and each worker imports it once, so it must be
module-level in a module importable from the controller's `sys.path`. A pool is started once
per (function, size, timeout) and lives across batches (`shared_pool`).
"""

from __future__ import annotations

import atexit
import importlib
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

from miles_like.user_code import import_spec
from miles_like.worker_pool import WorkerPool

# A reward beyond this is junk, not a signal: it would swamp the group's mean and std.
MAX_ABS_REWARD = 1e6


class Scored(NamedTuple):
    value: float  # 0.0 unless status == "ok"
    status: str  # "ok" | "error" (raised, not a number, or the worker died) | "nan" | "timeout"


class RewardResult(NamedTuple):
    scores: list[float]  # one per sample, in input order; 0.0 where the function failed
    num_errors: int  # calls that raised, returned something not a number, or crashed
    num_nan: int  # calls that returned NaN, +-inf or beyond +-MAX_ABS_REWARD
    num_timeouts: int = 0  # calls that outlived timeout_s (their worker killed and replaced)


def score_value(value: object) -> Scored:
    """A reward function's return value as a score: a real number (int, float, bool, numpy
    scalar) that is finite and within +-MAX_ABS_REWARD; anything else scores 0."""
    if not isinstance(value, numbers.Real):
        return Scored(0.0, "error")
    try:
        x = float(value)
    except (OverflowError, ValueError, TypeError):  # e.g. an int too large for a float
        return Scored(0.0, "error")
    if not math.isfinite(x) or abs(x) > MAX_ABS_REWARD:
        return Scored(0.0, "nan")
    return Scored(x, "ok")


def _scorer(spec: str, preload: str | None) -> Callable[[tuple[str, str, str]], Scored]:
    """In a worker: import the function `spec` names (and `preload`, so that the first call is
    not charged with it); the handler scores one (prompt, response, answer)."""
    fn = import_spec(spec, "reward.function")
    if preload is not None:
        importlib.import_module(preload)

    def score(job: tuple[str, str, str]) -> Scored:
        return score_value(fn(*job))

    return score


class RewardPool:
    """`size` worker processes scoring with the function `spec` (`module:qualname`),
    `timeout_s` per call; `preload` is a module each worker imports before its first call."""

    def __init__(self, spec: str, size: int, timeout_s: float, preload: str | None = None):
        self.spec, self.size, self.timeout_s = spec, size, timeout_s
        self._pool = WorkerPool(
            _scorer,
            (spec, preload),
            size=size,
            timeout_s=timeout_s,
            what=f"reward.function={spec!r}",
            name="reward-worker",
        )

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def pids(self) -> list[int]:
        return self._pool.pids()

    def close(self) -> None:
        self._pool.close()

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]
    ) -> RewardResult:
        if self.closed:
            raise RuntimeError("RewardPool.score after close()")
        outcomes = self._pool.map(list(zip(prompts, responses, answers)))
        results = [
            o.reply
            if o.status == "ok"
            else Scored(0.0, "timeout" if o.status == "timeout" else "error")
            for o in outcomes
        ]
        return RewardResult(
            [r.value for r in results],
            sum(r.status == "error" for r in results),
            sum(r.status == "nan" for r in results),
            sum(r.status == "timeout" for r in results),
        )


_pool: RewardPool | None = None
_pool_lock = threading.Lock()


def shared_pool(spec: str, size: int, timeout_s: float, preload: str | None) -> RewardPool:
    """The process's pool for these settings, started on first use; a pool for other settings
    is closed first (one set of workers at a time)."""
    global _pool
    with _pool_lock:
        if _pool is not None and (_pool.spec, _pool.size, _pool.timeout_s) != (
            spec,
            size,
            timeout_s,
        ):
            _pool.close()
            _pool = None
        if _pool is None or _pool.closed:
            _pool = RewardPool(spec, size, timeout_s, preload)
        return _pool


def current_pool() -> RewardPool | None:
    """The pool `shared_pool` last started, if any (for checks on its workers)."""
    return _pool


@atexit.register
def _close_shared_pool() -> None:
    if _pool is not None:
        _pool.close()
