"""pydantic's validation report -> one line that names the field and the fix.

The field is found by walking the error's location through the config's declared fields, so the
message speaks of the declared type and range (`rollout.top_p=1.5 is out of range; use a value in
(0, 1]`), never of pydantic's internals (which union arm failed, which validator ran).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from config_schema.describe import bare, is_config, type_name, yaml_repr

# a value pydantic's lax mode would have converted into something the user did not write
WRONG_TYPE = "wrong_type"
_BOUNDS = ("ge", "gt", "le", "lt")


def closest(key: str, valid: list[str]) -> str | None:
    """The valid name `key` most likely misspells, if any is close."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return match[0] if match else None


def display_name(field: str, prefix: str, names: Mapping[str, str]) -> str:
    """A field's name in messages: `names[field]` where its builder took it from elsewhere,
    else `prefix.field` (`field` alone at the top of a recipe)."""
    if field in names:
        return names[field]
    if not field:
        return prefix
    return f"{prefix}.{field}" if prefix else field


class _Where(NamedTuple):
    path: str  # dotted field path from the config's top ("" for the config itself)
    owner: type  # the config class whose keys the last step looked up
    hint: Any  # declared type at `path`
    bounds: dict  # declared ge / gt / le / lt at `path`
    unknown: str | None  # a key `owner` does not declare


def _bounds(metadata: list) -> dict:
    out = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.update(_bounds(m.metadata))
        for b in _BOUNDS:
            if getattr(m, b, None) is not None:
                out[b] = getattr(m, b)
    return out


def _config_in(hint: Any) -> type | None:
    """The config class a field of type `hint` holds (itself or optional), else None."""
    hint = bare(hint)
    for arm in (hint, *typing.get_args(hint)):
        if is_config(arm):
            return arm
    return None


def _locate(cls: type, loc: tuple) -> _Where:
    path, owner, hint, meta, container = "", cls, cls, [], cls
    for part in loc:
        if isinstance(part, int):  # an item of a tuple
            path += f"[{part}]"
            args = typing.get_args(bare(hint))
            item = args[0] if len(args) == 2 and args[1] is Ellipsis else args[part]
            meta = list(typing.get_args(item)[1:])  # Annotated[int, Field(ge=0)]
            hint, owner = item, None
        elif owner is not None and isinstance(part, str):
            container = owner
            if part not in owner.__pydantic_fields__:
                return _Where(path, owner, hint, {}, part)
            info = owner.__pydantic_fields__[part]
            path = f"{path}.{part}" if path else part
            hint, meta, owner = info.annotation, info.metadata, _config_in(info.annotation)
        # else: the name of a union arm pydantic tried; the field is already found
    return _Where(path, container, hint, _bounds(meta), None)


def _interval(bounds: dict) -> str:
    lo = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else "(-inf"
    hi = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else "inf)"
    return f"{lo}, {hi}"


def _unknown_key(where: _Where, prefix: str, names: Mapping[str, str]) -> str:
    section = display_name(where.path, prefix, names)
    full = f"{section}.{where.unknown}" if section else where.unknown
    valid = list(where.owner.__pydantic_fields__)
    near = where.owner.SUGGEST.get(where.unknown) or closest(where.unknown, valid)
    if near is not None:
        return f"{full}: unknown key; did you mean {section + '.' if section else ''}{near}?"
    return f"{full}: unknown key; valid keys{' of ' + section if section else ''} are " + ", ".join(
        valid
    )


def one_line(error: ValidationError, cls: type, prefix: str, names: Mapping[str, str]) -> str:
    """The first problem of `error` (raised validating config `cls`) as one line."""
    problem = error.errors(include_url=False)[0]
    kind, value, ctx = problem["type"], problem.get("input"), problem.get("ctx") or {}
    if kind in ("value_error", "assertion_error"):  # a rule's own line (`check`), or a nested
        return str(ctx.get("error", problem["msg"]))  # config's
    loc = tuple(problem["loc"])
    if "index" in ctx:  # the item of a tuple field that was not of the declared type
        loc, value = (*loc, ctx["index"]), value[ctx["index"]]
    where = _locate(cls, loc)
    if where.unknown is not None:
        return _unknown_key(where, prefix, names)
    name = display_name(where.path, prefix, names)
    if kind in ("missing", "missing_argument", "missing_keyword_only_argument"):
        return f"{name}: missing; set {name}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = where.bounds or {b: ctx[b] for b in _BOUNDS if b in ctx}
        return f"{name}={yaml_repr(value)} is out of range; use a value in {_interval(bounds)}"
    if kind == "finite_number":
        return f"{name}={yaml_repr(value)}: give a finite number"
    if kind == "literal_error":
        return f"{name}={yaml_repr(value)} is not allowed; use one of {type_name(where.hint)}"
    if _config_in(where.hint) is not None and kind.startswith(("dataclass", "model")):
        return (
            f"{name}: expected a section (a mapping of keys), got {yaml_repr(value)}; write "
            f"{name}: followed by indented key: value lines"
        )
    if kind == WRONG_TYPE or kind.endswith(("_type", "_parsing", "_from_float")):
        wanted = type_name(where.hint)
        return (
            f"{name}: expected {wanted}, got {yaml_repr(value)} ({type(value).__name__}); "
            f"give {name} a value of type {wanted}"
        )
    return f"{name}={yaml_repr(value)}: {problem['msg']}; fix it"
