"""Dotted `key=value` overrides of a recipe, as the command line takes them:
`rollout.n=4 trainer.lr=1e-5 cluster.address=null`."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from miles_like.errors import RecipeError


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """`["rollout.n=4"]` -> `[("rollout.n", 4)]`; values are parsed as YAML scalars."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError(f"override {item!r}: write dotted.key=value, e.g. rollout.n=4")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise RecipeError(f"override {item!r}: the value is not valid YAML; quote it") from None
        parsed.append((key, value))
    return parsed


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[tuple[str, Any]]
) -> dict[str, Any]:
    """A copy of the recipe mapping with each dotted key set (sections created as needed)."""
    out = copy.deepcopy(dict(data))
    for key, value in overrides:
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise RecipeError(
                    f"override {key}: {where} is a value, not a section; "
                    f"override {where}=... instead"
                )
            node = child
        node[parts[-1]] = value
    return out
