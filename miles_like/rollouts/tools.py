"""User tools, `rollout.tools: [module:fn, ...]`: naming, loading and checking them.

A tool is a plain module-level Python function. Loading one imports it in the controller to
read its schema (`tool_schema.py`: its `schema` attribute, or transformers' `get_json_schema`
of its annotations and docstring); its calls run on a pool of worker processes
(`tool_pool.py`: `ToolPool`, `ToolResult`, `ERROR_KINDS`, importable from here too). Every
problem with a spec is one `RecipeError` naming the recipe field and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jsonschema

from miles_like.errors import RecipeError
from miles_like.rollouts.tool_pool import ERROR_KINDS, ToolPool, ToolResult
from miles_like.rollouts.tool_schema import Tool, arguments_schema, function_schema
from miles_like.user_code import DOTTED, import_spec

__all__ = [
    "ERROR_KINDS",
    "Tool",
    "ToolPool",
    "ToolResult",
    "check_spec",
    "function_schema",
    "load_tool",
    "load_tools",
]

FIELD = "rollout.tools"
# a tool is a plain module-level function: no dotted attribute
_SPEC_RE = re.compile(rf"(?P<module>{DOTTED}):(?P<function>[A-Za-z_][A-Za-z0-9_]*)")


def check_spec(spec: str, field: str = FIELD) -> None:
    """The spec has the `module:function` form (nothing imported)."""
    if not isinstance(spec, str) or not _SPEC_RE.fullmatch(spec):
        raise RecipeError(
            f"{field}={spec!r}: name a tool as module:function, e.g. "
            "miles_like.tasks.calc:calculator"
        )


def load_tool(spec: str, field: str = FIELD) -> Tool:
    """The tool `module:fn` names (imported here to read its schema). RecipeError otherwise."""
    check_spec(spec, field)
    fn = import_spec(spec, field)
    if not callable(fn):
        raise RecipeError(f"{field}={spec!r} is not a function; name a plain Python function")
    try:
        schema = function_schema(fn)
        arguments = arguments_schema(fn, schema)
    except (TypeError, ValueError, jsonschema.SchemaError) as e:
        raise RecipeError(f"{field}={spec!r}: {str(e).splitlines()[0]}") from None
    return Tool(schema["function"]["name"], spec, schema, arguments)


def load_tools(specs: Sequence[str], field: str = FIELD) -> list[Tool]:
    tools = [load_tool(s, f"{field}[{i}]") for i, s in enumerate(specs)]
    names = [t.name for t in tools]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise RecipeError(
                f"{field}[{i}]={specs[i]!r}: a second tool named {n!r}; tool "
                "names must be unique (rename one or give it a schema name)"
            )
    return tools
