"""Tool calls on the worker pool (`miles_like/worker_pool.py`).

Every call returns a `ToolResult` whose `content` is what the model sees next: the tool's
output, or an error string when the tool raised, ran past `timeout_s` (its worker is killed
and replaced), ended its own process (`os._exit`, a segfault: the worker is replaced), returned
more than `max_output_chars` characters (counted in the worker: such an output never crosses),
got arguments that are not a JSON object matching its schema, or does not exist.
`ToolResult.error` names the kind (`ERROR_KINDS`) so that callers count them; no tool call
raises, and none blocks for longer than its timeout (plus a worker's restart when every worker
was just replaced). The tools' own prints go nowhere (they would interleave with the
controller's output).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jsonschema

from miles_like.rollouts.tool_schema import Tool
from miles_like.worker_pool import MAX_ERROR_CHARS, WorkerPool

ToolErrorKind = Literal[
    "raised", "timeout", "crashed", "flood", "bad_args", "unknown", "unavailable"
]
ERROR_KINDS: tuple[str, ...] = typing.get_args(ToolErrorKind)


class ToolResult(NamedTuple):
    content: str  # the tool message's content: output or error string
    error: ToolErrorKind | None = None  # None: the tool returned normally


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _runner(
    specs: dict[str, str], max_output_chars: int
) -> Callable[[tuple[str, dict]], tuple[str, Any]]:
    """In a worker: import the tools (name -> module:fn); the handler runs one call and caps
    its output here, so an oversized one never crosses the pipe."""
    fns = {}
    for name, spec in specs.items():
        module, attr = spec.split(":")
        fns[name] = getattr(importlib.import_module(module), attr)

    def run(job: tuple[str, dict]) -> tuple[str, Any]:
        name, arguments = job
        text = _as_text(fns[name](**arguments))
        return ("ok", text) if len(text) <= max_output_chars else ("flood", len(text))

    return run


class ToolPool:
    """`workers` spawned processes running `tools`. `call` is thread-safe and blocking;
    `acall` is its asyncio form. Use as a context manager, or `close()` it."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        workers: int = 2,
        timeout_s: float = 5.0,
        max_output_chars: int = 4000,
    ):
        if workers < 1 or timeout_s <= 0 or max_output_chars < 1:
            raise ValueError("ToolPool: workers >= 1, timeout_s > 0 and max_output_chars >= 1")
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self._validators = {t.name: jsonschema.Draft202012Validator(t.arguments) for t in tools}
        specs = {t.name: t.spec for t in tools}
        self._pool = (
            WorkerPool(
                _runner,
                (specs, max_output_chars),
                size=workers,
                timeout_s=timeout_s,
                what=f"rollout.tools={list(specs.values())}",
                name="tool-worker",
                quiet=True,
            )
            if tools
            else None
        )

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI `tools` list, for the chat template."""
        return [t.schema for t in self.tools.values()]

    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> typing.Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_arguments(self, name: str, arguments: Any) -> dict | ToolResult:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return ToolResult(
                    f"error: the arguments of {name} are not valid JSON "
                    f"({e.msg} at column {e.colno})",
                    "bad_args",
                )
        if not isinstance(arguments, dict):
            return ToolResult(
                f"error: the arguments of {name} must be a JSON object, not "
                f"{type(arguments).__name__}",
                "bad_args",
            )
        error = jsonschema.exceptions.best_match(self._validators[name].iter_errors(arguments))
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path) or "arguments"
            return ToolResult(
                f"error: {name} {where}: {error.message}"[:MAX_ERROR_CHARS], "bad_args"
            )
        return arguments

    def call(self, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
        """Run tool `name` with `arguments` (a dict, or the model's JSON text)."""
        if name not in self.tools:
            known = ", ".join(self.tools) or "none"
            return ToolResult(f"error: unknown tool {name!r} (tools: {known})", "unknown")
        checked = self._check_arguments(name, arguments)
        if isinstance(checked, ToolResult):
            return checked
        outcome = self._pool.call((name, checked))
        if outcome.status == "timeout":
            return ToolResult(f"error: {name} timed out after {self.timeout_s:g} s", "timeout")
        if outcome.status == "crashed":
            return ToolResult(
                f"error: {name} crashed its process (exit code {outcome.exitcode})", "crashed"
            )
        if outcome.status == "unavailable":
            return ToolResult(f"error: no tool worker available for {name}", "unavailable")
        if outcome.status == "raised":
            return ToolResult(f"error: {name} raised {outcome.reply}", "raised")
        kind, payload = outcome.reply
        if kind == "flood":
            return ToolResult(
                f"error: {name} returned {payload} characters, over the "
                f"{self.max_output_chars} limit",
                "flood",
            )
        return ToolResult(payload)

    async def acall(self, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
        return await asyncio.to_thread(self.call, name, arguments)
