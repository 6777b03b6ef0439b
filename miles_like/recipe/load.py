"""Reading a recipe: the YAML file, the command line's overrides, every check; and writing the
resolved recipe back as YAML."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from config_schema import to_plain, validate
from miles_like.errors import RecipeError
from miles_like.recipe.overrides import apply_overrides, parse_overrides
from miles_like.recipe.paths import check_paths
from miles_like.recipe.recipe import Recipe


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """A `Recipe` from a recipe YAML's mapping (its top-level keys may be any YAML scalar)."""
    return validate(Recipe, {str(k): v for k, v in data.items()})


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), *, check_paths_exist: bool = True
) -> Recipe:
    """Read a recipe YAML, apply dotted `key=value` overrides, validate. One RecipeError line on
    any problem.
    `check_paths_exist=False` skips the filesystem (model / data paths, user reward modules):
    for checking a recipe on a machine that lacks them."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(
            f"recipe {str(path)!r}: no such file; give the path of a recipe "
            "YAML, e.g. recipes/tiny_arith_grpo.yaml"
        ) from None
    except OSError as e:
        raise RecipeError(f"recipe {str(path)!r}: cannot read it ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "syntax error"
        raise RecipeError(
            f"recipe {str(path)!r}: invalid YAML{where}: {problem}; fix the syntax"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe {str(path)!r}: the top level must be a mapping of sections "
            "(model:, data:, rollout:, ...)"
        )
    recipe = recipe_from_dict(apply_overrides(data, parse_overrides(overrides)))
    if check_paths_exist:
        check_paths(recipe)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML; loading it again gives an equal recipe."""
    return yaml.safe_dump(to_plain(recipe), sort_keys=False, default_flow_style=False)
