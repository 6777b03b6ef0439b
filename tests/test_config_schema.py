"""The config validator (`config_schema`) on toy configs: what a field takes as written, ranges,
choices, unknown keys, renamed fields, naming by a builder, `describe`, and that a config stays
a frozen dataclass."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Annotated, Literal

import pytest
from pydantic import Field

from config_schema import (
    Config,
    ConfigError,
    Renamed,
    config,
    describe,
    to_plain,
    validate,
)


@config
class Toy(Config):
    PREFIX = "toy"
    ratio: float = Field(0.5, ge=0.0, lt=1.0, description="a ratio")
    count: int = Field(1, gt=0, description="a count")
    mode: Literal[0, 1] = Field(0, description="a mode")
    sizes: tuple[int, ...] = Field((1, 2), description="sizes")
    name: str | None = Field(None, description="a name")


def _as_choice(on: object) -> str:
    if not isinstance(on, bool):
        raise ValueError("expected true or false")
    return "b" if on else "a"


@config
class Outer(Config):
    PREFIX = ""
    SUGGEST = {"learning_rate": "steps"}
    RENAMED = {"old_steps": Renamed("steps"), "flag": Renamed("choice", _as_choice)}
    toy: Toy = Field(default_factory=Toy)
    steps: int = Field(3, ge=1)
    choice: Literal["a", "b"] = "a"
    ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    resume: Literal[False, "auto"] | str = False

    def check(self, name):
        if self.steps > 10 and self.choice == "b":
            raise ValueError(f"{name('steps')}={self.steps} is too many for {name('choice')}=b")


def test_coercion():
    t = Toy(**{"ratio": 0, "sizes": [3, 4], "name": "x"})
    assert t.ratio == 0.0 and isinstance(t.ratio, float)
    assert t.sizes == (3, 4) and isinstance(t.sizes, tuple)
    assert Toy(ratio="5e-1").ratio == 0.5  # PyYAML's string floats
    assert to_plain(t) == {"ratio": 0.0, "count": 1, "mode": 0, "sizes": [3, 4], "name": "x"}
    assert Outer(toy=None).toy == Toy()  # `toy:` with nothing under it: the defaults
    assert Outer(toy={"count": 2}).toy.count == 2


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"ratio": 1.0}, "toy.ratio=1.0 is out of range; use a value in [0.0, 1.0)"),
        ({"count": 0}, "toy.count=0 is out of range; use a value in (0, inf)"),
        ({"mode": True}, "toy.mode=true is not allowed; use one of 0 | 1"),
        ({"count": 1.5}, "toy.count: expected int, got 1.5"),
        ({"count": True}, "toy.count: expected int, got true (bool)"),
        ({"count": "3"}, "toy.count: expected int, got '3' (str)"),
        ({"ratio": True}, "toy.ratio: expected float, got true (bool)"),
        ({"ratio": float("nan")}, "toy.ratio=nan: give a finite number"),
        ({"sizes": [1, "a"]}, "toy.sizes[1]: expected int"),
        ({"sizes": [1, True]}, "toy.sizes[1]: expected int, got true (bool)"),
        ({"name": 3}, "toy.name: expected str | null"),
        ({"cuont": 3}, "toy.cuont: unknown key; did you mean toy.count?"),
        ({"zzz": 3}, "valid keys of toy are ratio, count, mode, sizes, name"),
    ],
)
def test_errors(data, needle):
    with pytest.raises(ConfigError) as info:
        Toy(**data)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"toy": 5}, "toy: expected a section (a mapping of keys), got 5"),
        ({"toy": {"count": 0}}, "toy.count=0 is out of range"),
        ({"toy": {1: 2}}, "toy.1: unknown key; valid keys of toy are"),
        ({"tooy": {}}, "tooy: unknown key; did you mean toy?"),
        ({"learning_rate": 3}, "learning_rate: unknown key; did you mean steps?"),
        ({"ids": [1, -1]}, "ids[1]=-1 is out of range; use a value in [0, inf)"),
        ({"resume": True}, "resume: expected false | auto | str, got true (bool)"),
        ({"steps": 11, "choice": "b"}, "steps=11 is too many for choice=b"),
        ({"flag": 3}, "flag=3: expected true or false"),
        ({"flag": True, "choice": "a"}, "flag is the former name of choice; set choice only"),
    ],
)
def test_nested_and_rule_errors(data, needle):
    with pytest.raises(ConfigError) as info:
        Outer(**data)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_direct_construction_and_replace_are_checked_too():
    with pytest.raises(ConfigError, match="toy.count"):
        Toy(count=-1)
    toy = Toy(count=2)
    assert dataclasses.replace(toy, count=3).count == 3
    with pytest.raises(ConfigError, match="toy.count=-3"):
        dataclasses.replace(toy, count=-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        toy.count = 4
    assert pickle.loads(pickle.dumps(toy)) == toy and hash(toy) == hash(Toy(count=2))


def test_renamed_fields_warn_and_map_onto_the_new_ones():
    with pytest.warns(DeprecationWarning, match=r"^old_steps is deprecated; write steps instead"):
        assert Outer(old_steps=5).steps == 5
    with pytest.warns(DeprecationWarning, match=r"^flag is deprecated; write choice: b instead"):
        assert Outer(flag=True).choice == "b"


def test_a_builder_names_the_fields_its_way():
    """`validate(..., prefix=, names=)`: field errors and the rules' errors alike."""
    with pytest.raises(ConfigError, match=r"^section\.steps=0 is out of range"):
        validate(Outer, {"steps": 0}, prefix="section")
    with pytest.raises(ConfigError, match=r"^top\.n=11 is too many for section\.choice=b$"):
        validate(Outer, {"steps": 11, "choice": "b"}, prefix="section", names={"steps": "top.n"})
    with pytest.raises(ConfigError, match=r"^top\.n=11 is too many for choice=b$"):
        validate(Outer, {"steps": 11, "choice": "b"}, names={"steps": "top.n"})
    assert validate(Outer, {"steps": 4}) == Outer(steps=4)


def test_error_is_one_line():
    assert str(ConfigError("a\nb   c")) == "a b c"


def test_describe():
    rows = describe(Toy, "toy")
    assert rows[0] == ("toy.ratio", "float", "0.5", "a ratio")
    assert rows[2] == ("toy.mode", "0 | 1", "0", "a mode")
    assert rows[3][1:3] == ("list of int", "[1, 2]") and rows[4][1:3] == ("str | null", "null")
    assert [r[0] for r in describe(Outer)][:2] == ["toy.ratio", "toy.count"]
