"""The typed validator on a toy section: coercion rules, ranges, unknown keys, describe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from miles_like.recipe.schema import RecipeError, Section, describe, from_dict, setting, to_plain


@dataclass(frozen=True)
class Toy(Section):
    PATH = "toy"
    ratio: float = setting(0.5, "a ratio", ge=0.0, lt=1.0)
    count: int = setting(1, "a count", gt=0)
    mode: Literal[0, 1] = setting(0, "a mode")
    sizes: tuple[int, ...] = setting((1, 2), "sizes")
    name: str | None = setting(None, "a name")


def test_coercion():
    t = from_dict(Toy, {"ratio": 0, "sizes": [3, 4], "name": "x"}, "toy")
    assert t.ratio == 0.0 and isinstance(t.ratio, float)
    assert t.sizes == (3, 4) and isinstance(t.sizes, tuple)
    assert from_dict(Toy, {"ratio": "5e-1"}, "toy").ratio == 0.5  # PyYAML's string floats
    assert to_plain(t) == {"ratio": 0.0, "count": 1, "mode": 0, "sizes": [3, 4], "name": "x"}


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"ratio": 1.0}, "toy.ratio=1.0 is out of range; use a value in [0.0, 1.0)"),
        ({"count": 0}, "toy.count=0 is out of range; use a value in (0, inf)"),
        ({"mode": True}, "toy.mode=true is not allowed; use one of 0 | 1"),
        ({"count": 1.5}, "toy.count: expected int, got 1.5"),
        ({"sizes": [1, "a"]}, "toy.sizes[1]: expected int"),
        ({"name": 3}, "toy.name: expected str | null"),
        ({"cuont": 3}, "toy.cuont: unknown key; did you mean toy.count?"),
        ({"zzz": 3}, "valid keys of toy are ratio, count, mode, sizes, name"),
    ],
)
def test_errors(data, needle):
    with pytest.raises(RecipeError) as info:
        from_dict(Toy, data, "toy")
    assert needle in str(info.value)


def test_direct_construction_is_checked_too():
    with pytest.raises(RecipeError, match="toy.count"):
        Toy(count=-1)


def test_recipe_error_is_one_line():
    assert str(RecipeError("a\nb   c")) == "a b c"


def test_describe():
    rows = describe(Toy, "toy")
    assert rows[0] == ("toy.ratio", "float", "0.5", "a ratio")
    assert rows[2] == ("toy.mode", "0 | 1", "0", "a mode")
    assert rows[3][1:3] == ("list of int", "[1, 2]") and rows[4][1:3] == ("str | null", "null")
