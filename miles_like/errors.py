"""Errors that end a run with one line on stderr and no traceback (see `recipe/cli.py`)."""

from __future__ import annotations

from config_schema import ConfigError

__all__ = ["RecipeError", "RolloutFailed", "RunFailed"]


class RecipeError(ConfigError):
    """A user error in a recipe, an override or a file it names (exit code 2): one line that
    names the dotted field and the fix."""


class RunFailed(RuntimeError):
    """The run stopped on an actor's death or an actor call's timeout (exit code 1). The message
    is one line: what failed and how to continue."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RolloutFailed(RunFailed):
    """A rollout function raised, returned a malformed group, or hung (exit code 1). The
    message names the function and the prompt."""
