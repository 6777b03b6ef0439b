"""Errors that end a run with one line on stderr and no traceback (see `cli.main`)."""

from __future__ import annotations

from miles_like.recipe.schema import RecipeError

__all__ = ["RecipeError", "RolloutFailed", "RunFailed"]


class RunFailed(RuntimeError):
    """The run stopped on an actor's death or an actor call's timeout (exit code 1). The message
    is one line: what failed and how to continue."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RolloutFailed(RunFailed):
    """A rollout function raised, returned a malformed group, or hung (exit code 1). The
    message names the function and the prompt."""
