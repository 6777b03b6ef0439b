"""Naming rollout functions (`rollout.function`): a built-in name or `module:function`, checked
without importing anything (recipe validation) and resolved when the run starts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from miles_like.errors import RecipeError
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
