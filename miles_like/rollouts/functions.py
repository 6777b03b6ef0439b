"""Rollout functions (`rollout.function`): naming them (a built-in name or `module:function`,
checked without importing anything at recipe validation, resolved when the run starts), and
checking what one returns. A rollout function is user code: whatever it raises or returns
wrongly ends the run with one line naming the function, the prompt and the faulty line."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from typing import Any

from miles_like.errors import RecipeError, RolloutFailed
from miles_like.rollouts.trajectory import Trajectory
from miles_like.user_code import SPEC_RE, import_spec

SPEC_FIELD = "rollout.function"
BUILTIN_ROLLOUTS = {
    "single_turn": "miles_like.rollouts.single_turn:single_turn",
    "tool_loop": "miles_like.rollouts.tool_loop:tool_loop",
}


def check_rollout_spec(spec: str) -> None:
    if spec in BUILTIN_ROLLOUTS or SPEC_RE.fullmatch(spec):
        return
    raise RecipeError(
        f"{SPEC_FIELD}={spec!r}: use a built-in ({' | '.join(BUILTIN_ROLLOUTS)}) "
        "or module:function, e.g. my_agent:rollout"
    )


def resolve_rollout_function(spec: str) -> Callable[..., Any]:
    """The async function `spec` names (a user module is imported: it must be on sys.path)."""
    check_rollout_spec(spec)
    obj = import_spec(BUILTIN_ROLLOUTS.get(spec, spec), SPEC_FIELD)
    if not asyncio.iscoroutinefunction(obj):
        raise RecipeError(
            f"{SPEC_FIELD}={spec!r} is not an async function; define "
            "async def fn(ctx, problem) -> list[Trajectory]"
        )
    return obj


def check_group(out, n: int, context_len: int) -> None:
    """Raise ValueError / TypeError (one line) unless `out` is a list of `n` consistent
    Trajectory, none longer than `context_len` tokens."""
    if not isinstance(out, list) or len(out) != n:
        raise ValueError(
            f"returned {type(out).__name__} of "
            f"{len(out) if hasattr(out, '__len__') else '?'} items; return a "
            f"list of rollout.n={n} Trajectory"
        )
    for j, t in enumerate(out):
        if not isinstance(t, Trajectory):
            raise TypeError(f"item {j} is a {type(t).__name__}, not a Trajectory")
        try:
            t.check()
            if len(t.token_ids) > context_len:
                raise ValueError(
                    f"{len(t.token_ids)} tokens exceed the context of "
                    f"{context_len} (check ctx.room before a turn)"
                )
        except (TypeError, ValueError) as e:
            raise type(e)(f"trajectory {j}: {e}") from None


def function_failed(spec: str, prompt: str, error: BaseException) -> RolloutFailed:
    """The run's one line for `error`, raised by the rollout function `spec` (or found by
    `check_group` in what it returned) on `prompt`."""
    return RolloutFailed(
        f"{SPEC_FIELD}={spec!r} failed on the prompt {prompt!r}: "
        f"{where(error)}{type(error).__name__}: {error}"
    )


def where(error: BaseException) -> str:
    """'file.py:12: ' for the innermost frame that raised `error` (user code, usually)."""
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}: " if frames else ""
