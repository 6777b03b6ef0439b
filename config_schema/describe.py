"""Configs written for people: every field as a row (name, type, default, doc) for `--help` and
the documentation's field tables, type names and values as a YAML recipe writes them."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal, Union


def is_config(hint: Any) -> bool:
    """`hint` is a config class (a pydantic dataclass)."""
    return (
        isinstance(hint, type)
        and dataclasses.is_dataclass(hint)
        and hasattr(hint, "__pydantic_fields__")
    )


def bare(hint: Any) -> Any:
    """`hint` without `Annotated[...]` (constraints of tuple items ride on it)."""
    while typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    return hint


def yaml_repr(value: Any) -> str:
    """A value as a recipe writes it (true, null, 'text', 3)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def type_name(hint: Any) -> str:
    """The type of a field as errors and `--help` write it."""
    hint = bare(hint)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(a if isinstance(a, str) else yaml_repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if origin is tuple:
        items = list(dict.fromkeys(type_name(a) for a in typing.get_args(hint) if a is not ...))
        return f"list of {' or '.join(items)}"
    if hint is type(None):
        return "null"
    if is_config(hint):
        return "section"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(hint, str(hint))


def to_plain(obj: Any) -> Any:
    """A config as plain YAML-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def describe(cls: type, path: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) of every leaf field of `cls`, in declaration order;
    a nested config's fields under its name."""
    rows = []
    for name, info in cls.__pydantic_fields__.items():
        full = f"{path}.{name}" if path else name
        if is_config(info.annotation):
            rows.extend(describe(info.annotation, full))
            continue
        if info.is_required():
            text = "(required)"
        else:
            default = to_plain(info.get_default(call_default_factory=True))
            text = yaml_repr(default) if default is None or isinstance(default, bool) else default
        rows.append((full, type_name(info.annotation), str(text), info.description or ""))
    return rows
