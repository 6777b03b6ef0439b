"""A small typed validator for frozen config dataclasses (the recipe's sections).

Each section subclasses `Section`; its fields are declared with `setting(default, doc, ...)`,
which records the help text and an optional numeric range. On construction every field is checked
against its type hint (bool, int, float, str, Literal, Optional, tuple[...], nested sections) and
range, and coerced where YAML is loose (an int where a float is expected; PyYAML reads `1e-6`
as a string, so a float field accepts a string that parses as a float). Every failure raises one
`RecipeError` whose message is a single line naming the dotted field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Union


class RecipeError(ValueError):
    """A user error in a recipe or an override: one line, names the dotted field and the fix."""

    def __init__(self, message: str):
        # One line, always: the CLI prints it as is.
        super().__init__(" ".join(str(message).split()))


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with help text and an optional range (checked when not None)."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def type_name(hint: Any) -> str:
    """Human-readable type of a field, for errors and --help."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(a if isinstance(a, str) else yaml_repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if origin is tuple:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "section"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(hint, str(hint))


def yaml_repr(value: Any) -> str:
    """A value as a recipe writes it (true, null, 'text', 3)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _fail_type(path: str, hint: Any, value: Any) -> RecipeError:
    return RecipeError(
        f"{path}: expected {type_name(hint)}, got {yaml_repr(value)} "
        f"({type(value).__name__}); give {path} a value of type {type_name(hint)}"
    )


def coerce(hint: Any, value: Any, path: str) -> Any:
    """`value` checked against `hint` (and converted where YAML is loose), or a RecipeError."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None:
            if type(None) in args:
                return None
            raise RecipeError(f"{path}: may not be null; give a {type_name(hint)}")
        for arm in args:
            if arm is type(None):
                continue
            try:
                return coerce(arm, value, path)
            except RecipeError:
                continue
        raise _fail_type(path, hint, value)
    if origin is Literal:
        # `type(a) is type(value)`: True == 1 in Python, but `true` is not a valid `0 | 1`.
        for a in typing.get_args(hint):
            if a == value and type(a) is type(value):
                return value
        raise RecipeError(f"{path}={yaml_repr(value)} is not allowed; use one of {type_name(hint)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _fail_type(path, hint, value)
        (item,) = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return tuple(coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if value is None:  # `rollout:` with nothing under it: the section's defaults
            return from_dict(hint, {}, path)
        if isinstance(value, Mapping):
            return from_dict(hint, value, path)
        raise RecipeError(
            f"{path}: expected a section (a mapping of keys), got {value!r}; "
            f"write {path}: followed by indented key: value lines"
        )
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _fail_type(path, hint, value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _fail_type(path, hint, value)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _fail_type(path, hint, value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _fail_type(path, hint, value)
    raise TypeError(f"schema: unsupported type hint {hint!r} at {path}")  # a bug in the schema


def _check_range(path: str, value: Any, meta: Mapping[str, Any]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and math.isnan(value):
        raise RecipeError(f"{path}=nan; give a number")
    if meta.get("ge") is not None:
        lo = f"[{meta['ge']}"
    elif meta.get("gt") is not None:
        lo = f"({meta['gt']}"
    else:
        lo = "(-inf"
    if meta.get("le") is not None:
        hi = f"{meta['le']}]"
    elif meta.get("lt") is not None:
        hi = f"{meta['lt']})"
    else:
        hi = "inf)"
    ok = (
        (meta.get("ge") is None or value >= meta["ge"])
        and (meta.get("gt") is None or value > meta["gt"])
        and (meta.get("le") is None or value <= meta["le"])
        and (meta.get("lt") is None or value < meta["lt"])
    )
    if not ok:
        raise RecipeError(f"{path}={value!r} is out of range; use a value in {lo}, {hi}")


def closest(key: str, valid: list[str]) -> str | None:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return match[0] if match else None


def unknown_key_error(
    path: str, key: str, valid: list[str], aliases: Mapping[str, str] | None = None
) -> RecipeError:
    full = f"{path}.{key}" if path else str(key)
    near = (aliases or {}).get(str(key)) or closest(str(key), valid)
    prefix = f"{path}." if path else ""
    if near is not None:
        return RecipeError(f"{full}: unknown key; did you mean {prefix}{near}?")
    return RecipeError(
        f"{full}: unknown key; valid keys{' of ' + path if path else ''} are {', '.join(valid)}"
    )


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys (with the closest valid one)."""
    if not isinstance(data, Mapping):
        where = path or "the recipe"
        raise RecipeError(f"{where}: expected a mapping of key: value, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            raise unknown_key_error(path, key, names, getattr(cls, "ALIASES", None))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            full = f"{path}.{f.name}" if path else f.name
            kwargs[f.name] = coerce(hints[f.name], data[f.name], full)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            full = f"{path}.{f.name}" if path else f.name
            raise RecipeError(f"{full}: missing; add {full} to the recipe (see --help)")
    return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of the recipe's sections: fields are type- and range-checked on construction, then
    `check()` runs the section's cross-field rules. `PATH` is the section's dotted name."""

    PATH: ClassVar[str] = ""
    # Names other frameworks use for our fields, suggested when a recipe uses them.
    ALIASES: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            path = f"{self.PATH}.{f.name}" if self.PATH else f.name
            value = coerce(hints[f.name], getattr(self, f.name), path)
            _check_range(path, value, f.metadata)
            # frozen: set only to store the coerced value (int -> float, list -> tuple)
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Cross-field rules of the section; raise RecipeError naming the field."""


def to_plain(obj: Any) -> Any:
    """A section as plain YAML-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def describe(cls: type, path: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) of every leaf field of `cls`, in declaration order."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{path}.{f.name}" if path else f.name
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, name))
            continue
        if f.default is not dataclasses.MISSING:
            default = to_plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = to_plain(f.default_factory())
        else:
            default = "(required)"
        default_text = (
            "null"
            if default is None
            else str(default).lower()
            if isinstance(default, bool)
            else str(default)
        )
        rows.append((name, type_name(hint), default_text, f.metadata.get("doc", "")))
    return rows
