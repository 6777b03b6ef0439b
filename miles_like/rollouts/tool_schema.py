"""What a tool is (`Tool`) and how it is described: its OpenAI-format schema, which the chat
template renders in the prompt, and the JSON Schema a call's arguments are checked against.

A tool's schema is its `schema` attribute when it has one, else transformers'
`get_json_schema` of the function (annotations + a Google-style docstring: a description, and
an `Args:` line for every argument), the very schema `apply_chat_template(tools=[fn])` renders
for a function. transformers writes an optional argument OpenAPI-style (`"nullable": true`);
the arguments are checked against the same schema read as JSON Schema (a nullable value may
also be null), with no properties beyond the signature's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema


@dataclass(frozen=True)
class Tool:
    name: str  # what the model calls it by
    spec: str  # module:fn, imported again in each worker process
    schema: dict[str, Any]  # OpenAI format: {"type": "function", "function": {...}}
    arguments: dict[str, Any]  # the JSON Schema a call's arguments must match

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"]["parameters"]


def function_schema(fn: Callable, name: str | None = None) -> dict[str, Any]:
    """The OpenAI `tools` entry of `fn`: its `schema` attribute (the entry itself, or just its
    `function` part), else transformers' `get_json_schema`. TypeError / ValueError name what
    cannot be described and how to fix it."""
    name = name or fn.__name__
    explicit = getattr(fn, "schema", None)
    if explicit is not None:
        if not isinstance(explicit, Mapping):
            raise TypeError(f"{name}.schema must be a dict in the OpenAI tools format")
        entry = (
            dict(explicit)
            if "function" in explicit
            else {"type": "function", "function": dict(explicit)}
        )
        function = entry["function"]
        function.setdefault("name", name)
        function.setdefault("parameters", {"type": "object", "properties": {}})
        jsonschema.Draft202012Validator.check_schema(function["parameters"])
        return entry
    _check_signature(fn, name)
    # imported here: the tool workers import this module (for `Tool`) and never derive schemas
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    try:
        entry = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ValueError(
            f"{e}; write a Google-style docstring (a description, then an Args: line per "
            "argument) or give the function a `schema` attribute"
        ) from None
    entry["function"]["name"] = name
    return entry


def _check_signature(fn: Callable, name: str) -> None:
    """The checks transformers does not make: a tool takes named, annotated arguments (a
    `*args` would be described as one required argument that no call can pass)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: cannot read its signature ({e})") from None
    for p in signature.parameters.values():
        where = f"{name}({p.name})"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(
                f"{where}: tools take named arguments only (no *args, **kwargs or "
                "positional-only parameters)"
            )
        if p.annotation is p.empty:
            raise TypeError(f"{where}: annotate the parameter's type (str, int, ...)")


def arguments_schema(fn: Callable, entry: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema a call's arguments must match: the entry's parameters as given for a
    `schema` attribute; for a derived schema, JSON Schema proper (`nullable` -> a null type)
    and closed to the signature's arguments."""
    parameters = entry["function"]["parameters"]
    if getattr(fn, "schema", None) is not None:
        return parameters
    return {**_json_schema(parameters), "additionalProperties": False}


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """transformers' (OpenAPI-flavoured) schema of a value as JSON Schema: `"nullable": true`
    becomes "null" among the types (and None among the enum's values), recursively."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _json_schema(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _json_schema(out[key])
    for key in ("prefixItems", "anyOf"):
        if key in out:
            out[key] = [_json_schema(s) for s in out[key]]
    if out.pop("nullable", False):
        kind = out.get("type")
        if kind is not None:
            out["type"] = [*kind, "null"] if isinstance(kind, list) else [kind, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        if "anyOf" in out:
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    return out
