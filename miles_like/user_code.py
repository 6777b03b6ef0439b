"""Importing what a recipe names as `module:attr` (reward functions, rollout functions, tools):
user code, so every failure is one `RecipeError` naming the recipe field and the fix."""

from __future__ import annotations

import importlib
import re
from typing import Any

from miles_like.errors import RecipeError

DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
# `module:attr`, both dotted names: what recipes write for user code
SPEC_RE = re.compile(rf"(?P<module>{DOTTED}):(?P<function>{DOTTED})")


def import_spec(spec: str, field: str) -> Any:
    """The object `module:attr` names (`attr` may be dotted); the module is imported, so it must
    be on sys.path. `spec` is already checked to have that form."""
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RecipeError(
            f"{field}={spec!r}: cannot import module {e.name!r}; put it on PYTHONPATH or fix the "
            "name"
        ) from None
    except Exception as e:  # noqa: BLE001 (the user's module failed while importing)
        raise RecipeError(
            f"{field}={spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}; fix "
            "that module"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RecipeError(
                f"{field}={spec!r}: module {module_name!r} has no {attr!r}; fix the function name"
            )
        obj = getattr(obj, part)
    return obj
