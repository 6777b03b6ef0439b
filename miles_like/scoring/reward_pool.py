"""A persistent pool of worker processes that scores (prompt, response, answer) triples with one
reward function, each call bounded in time.

A reward function is user code run on model output: it may hang (a pathological expression in
sympy), crash its process (a segfault in a C extension, `os._exit`), raise, or return junk. None
of that may stall or kill the run, so every call runs in a worker process, never in the
controller: a call that outlives `timeout_s` has its worker killed and replaced, a worker that
dies is replaced, and the sample scores 0 either way, counted. Only a float crosses back (the
worker checks the value), so a huge or unpicklable return value cannot flood the controller.

Workers are spawned (a fresh interpreter, not a fork of a controller holding Ray and torch
threads) and live across calls: a pool is started once per (function, size, timeout). The
function travels by name (`module:function` or a built-in name) and each worker imports it, so
a user module must be importable from the controller's `sys.path` (spawn passes it on), and
the function must be module-level: a closure or lambda cannot be named and is refused. Workers
are daemonic: a user function may start subprocesses but not multiprocessing children.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import numbers
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import NamedTuple

# A reward beyond this is junk, not a signal: it would swamp the group's mean and std.
MAX_ABS_REWARD = 1e6
# A spawned worker imports the function's module (math-verify pulls in sympy); far more than that
# means the import itself hangs.
STARTUP_TIMEOUT_S = 120.0
_READY = "ready"


class Scored(NamedTuple):
    value: float  # 0.0 unless status == "ok"
    status: str  # "ok" | "error" (raised, not a number, or the worker died) | "nan" | "timeout"


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


def _serve(conn: Connection, spec: str, preload: str | None) -> None:
    """Worker main loop: import the function, say ready, then score jobs until the pipe closes."""
    import importlib

    from miles_like.run.orphans import exit_with_parent
    from miles_like.scoring.rewards import resolve_reward

    exit_with_parent()  # a function that never returns must not outlive the controller
    try:
        fn = resolve_reward(spec)
        if preload is not None:
            importlib.import_module(preload)
    except BaseException as e:  # reported to the controller, which raises it there
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(_READY)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the controller closed the pool or died
            return
        index, prompt, response, answer = job
        try:
            scored = score_value(fn(prompt, response, answer))
        except (Exception, SystemExit):  # a user function's failure is a sample's 0, counted
            scored = Scored(0.0, "error")
        conn.send((index, *scored))


class _Worker:
    def __init__(self, ctx, spec: str, preload: str | None):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(child, spec, preload), daemon=True, name="reward-worker"
        )
        self.proc.start()
        child.close()  # the child holds the other end: its exit is EOF here
        self.ready = False
        self.started = time.monotonic()
        self.job: tuple[int, float] | None = None  # (sample index, deadline) while busy

    def kill(self) -> None:
        # Our child is never reaped by anyone else, so its pid cannot have been reused: the
        # signal reaches the worker or (already dead) nothing.
        self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class PoolCounts(NamedTuple):
    scores: list[float]
    num_errors: int
    num_nan: int
    num_timeouts: int


class RewardPool:
    """`size` worker processes scoring with the function named `spec`, `timeout_s` per call."""

    def __init__(self, spec: str, size: int, timeout_s: float, preload: str | None = None):
        if size < 1 or timeout_s <= 0:
            raise ValueError(
                f"RewardPool: size={size}, timeout_s={timeout_s}; use size >= 1 and timeout_s > 0"
            )
        self.spec, self.size, self.timeout_s, self.preload = spec, size, timeout_s, preload
        self._ctx = multiprocessing.get_context("spawn")
        self._workers = [self._start() for _ in range(size)]
        self._lock = threading.Lock()  # one batch at a time: replies are matched by index
        self.replaced = 0  # workers killed (timeout) or dead (crash), replaced

    def _start(self) -> _Worker:
        return _Worker(self._ctx, self.spec, self.preload)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._start()
        self.replaced += 1

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]
    ) -> PoolCounts:
        with self._lock:
            if not self._workers:
                raise RuntimeError("RewardPool.score after close()")
            try:
                results = self._run(list(zip(prompts, responses, answers)))
            except BaseException:
                self.close()  # replies still in flight must not reach another batch
                raise
        return PoolCounts(
            [r.value for r in results],
            sum(r.status == "error" for r in results),
            sum(r.status == "nan" for r in results),
            sum(r.status == "timeout" for r in results),
        )

    def _run(self, jobs: list[tuple[str, str, str]]) -> list[Scored]:
        results: list[Scored | None] = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        while todo or any(w.job is not None for w in self._workers):
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.ready and w.job is None and todo:
                    index = todo[0]
                    try:
                        w.conn.send((index, *jobs[index]))
                    except OSError:  # it died idle (killed from outside): replace it, retry
                        self._replace(i)
                        continue
                    todo.popleft()
                    w.job = (index, now + self.timeout_s)
            deadlines = [
                w.job[1] if w.job else w.started + STARTUP_TIMEOUT_S
                for w in self._workers
                if w.job or not w.ready
            ]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            ready = set(wait([w.conn for w in self._workers], wait_s))
            for i, w in enumerate(self._workers):
                if w.conn not in ready:
                    continue
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):  # the worker died: a crash in the function
                    if w.job is not None:
                        results[w.job[0]] = Scored(0.0, "error")
                    elif not w.ready:
                        raise RuntimeError(
                            f"reward.function={self.spec!r}: a reward worker died while starting"
                        ) from None
                    self._replace(i)
                    continue
                if message == _READY:
                    w.ready = True
                elif message[0] == "failed":
                    raise RuntimeError(
                        f"reward.function={self.spec!r}: a reward worker could "
                        f"not load it: {message[1]}"
                    )
                else:
                    index, value, status = message
                    results[index] = Scored(value, status)
                    w.job = None
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.job is not None and now >= w.job[1]:
                    results[w.job[0]] = Scored(0.0, "timeout")
                    self._replace(i)
                elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
                    raise RuntimeError(
                        f"reward.function={self.spec!r}: a reward worker did not "
                        f"start within {STARTUP_TIMEOUT_S:.0f} s"
                    )
        return results  # type: ignore[return-value]


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
        if _pool is None or not _pool._workers:
            _pool = RewardPool(spec, size, timeout_s, preload)
        return _pool


@atexit.register
def _close_shared_pool() -> None:
    if _pool is not None:
        _pool.close()
