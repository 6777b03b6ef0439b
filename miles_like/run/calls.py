"""Waiting on actor calls. Every blocking wait of the controller goes through `wait_all`, which
never waits longer than `cluster.call_timeout_s` and names the actor and method of whatever went
wrong, so a dead or hung actor stops the run with one line instead of a hang or a traceback.

    results = wait_all([start_call("trainer rank 0", t, "train", batch), ...], timeout_s)
    results = wait_all(start_on_all("trainer rank", trainers, "train", batch), timeout_s)

A call whose actor died raises `ActorDied` (or, with `on_death`, is replaced by the call that
function returns: how a dead engine's rollout share is regenerated on its replacement). An
exception raised *by* the method (a bug, a user error found inside an actor) propagates as Ray
raised it. Results are in call order; the first failure raises at once, without waiting for the
other calls (they may be blocked in a collective with the dead actor).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ray
from ray.exceptions import RayActorError, RayTaskError


class Call(NamedTuple):
    actor: str  # e.g. "trainer rank 0", "engine 1"
    method: str
    ref: Any  # ray.ObjectRef


def start_call(actor: str, handle, method: str, *args) -> Call:
    """Start `handle.method(*args)` (non-blocking)."""
    return Call(actor, method, getattr(handle, method).remote(*args))


def start_on_all(role: str, handles: Sequence, method: str, *args) -> list[Call]:
    """The same call started on every actor of a group, labelled `{role} {index}`."""
    return [start_call(f"{role} {i}", h, method, *args) for i, h in enumerate(handles)]


class ActorDied(RuntimeError):
    def __init__(self, actor: str, method: str, cause: BaseException):
        self.actor, self.method, self.reason = actor, method, death_reason(cause)
        super().__init__(f"{actor} died (during {method}): {self.reason}")


class CallTimeout(RuntimeError):
    def __init__(self, calls: Sequence[Call], timeout_s: float):
        self.calls = list(calls)
        names = ", ".join(f"{c.actor} {c.method}" for c in calls)
        super().__init__(
            f"{names}: no answer within {timeout_s:g} s (cluster.call_timeout_s); "
            "the actor is hung, or the call needs a larger timeout"
        )


def death_reason(error: BaseException) -> str:
    """One line out of Ray's multi-line actor-death message."""
    text = str(getattr(error, "error_msg", None) or error)
    if "ray.kill" in text:
        return "killed by ray.kill"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


def is_death(error: BaseException) -> bool:
    # A method that raised because *another* actor died is a RayTaskError (possibly also an
    # instance of RayActorError, through Ray's cause mixin): not this actor's death.
    return isinstance(error, RayActorError) and not isinstance(error, RayTaskError)


def wait_all(
    calls: Sequence[Call],
    timeout_s: float,
    on_death: Callable[[int, ActorDied], Call] | None = None,
) -> list:
    """The results of `calls`, in order. Waits at most `timeout_s` in all, extended to
    `timeout_s` from now whenever a replacement call starts."""
    calls = list(calls)
    results: list = [None] * len(calls)
    waiting = {c.ref: i for i, c in enumerate(calls)}
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(left, 0.0))
        if not ready:
            raise CallTimeout([calls[i] for i in waiting.values()], timeout_s)
        i = waiting.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
        except Exception as e:
            if not is_death(e):
                raise
            died = ActorDied(calls[i].actor, calls[i].method, e)
            if on_death is None:
                raise died from None
            calls[i] = on_death(i, died)
            waiting[calls[i].ref] = i
            deadline = max(deadline, time.monotonic() + timeout_s)
    return results
