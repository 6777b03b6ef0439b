"""Running user tools safely: `rollout.tools: [module:fn, ...]`.

A tool is a plain Python function. Its OpenAI-format schema (what the chat template renders in
the prompt, and what a call's arguments are validated against) is the function's `schema`
attribute when it has one, else derived from its signature's annotations and its docstring (the
first paragraph describes the tool; a Google-style `Args:` section describes the parameters).

Calls run in a small pool of worker processes started with the `spawn` method, so a tool can
neither corrupt nor stall the process that drives the rollouts. Every call returns a
`ToolResult` whose `content` is what the model sees next: the tool's output, or an error string
when the tool raised, ran past `timeout_s` (its worker is killed and replaced), ended its own
process (`os._exit`, a segfault: the worker is replaced), returned more than `max_output_chars`
characters, got arguments that are not a JSON object matching the schema, or does not exist.
`ToolResult.error` names the kind (`ERROR_KINDS`) so that callers count them; no tool call
raises, and none blocks for longer than its timeout (plus a worker's restart when every worker
was just replaced).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import multiprocessing
import os
import queue
import re
import threading
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jsonschema

from miles_like.recipe.schema import RecipeError
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

ToolErrorKind = Literal[
    "raised", "timeout", "crashed", "flood", "bad_args", "unknown", "unavailable"
]
ERROR_KINDS: tuple[str, ...] = typing.get_args(ToolErrorKind)
FIELD = "rollout.tools"
WORKER_START_TIMEOUT_S = 120.0  # a fresh interpreter importing the tool modules
MAX_ERROR_CHARS = 300  # an exception's message as the model sees it

# a tool is a plain module-level function: no dotted attribute
_SPEC_RE = re.compile(rf"(?P<module>{DOTTED}):(?P<function>[A-Za-z_][A-Za-z0-9_]*)")


class ToolResult(NamedTuple):
    content: str  # the tool message's content: output or error string
    error: ToolErrorKind | None = None  # None: the tool returned normally


@dataclass(frozen=True)
class Tool:
    name: str  # what the model calls it by
    spec: str  # module:fn, imported again in each worker process
    schema: dict[str, Any]  # OpenAI format: {"type": "function", "function": {...}}

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"]["parameters"]


# ------------------------------------------------------------------------------------ schemas
_JSON_TYPES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of an annotation: str, int, float, bool, None, list[X], dict[str, X],
    Literal[...], X | Y."""
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_json_type(a, where) for a in args]}
    if origin is list and len(args) <= 1:
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if origin is dict and (not args or args[0] is str):
        return {
            "type": "object",
            **({"additionalProperties": _json_type(args[1], where)} if args else {}),
        }
    raise TypeError(
        f"{where}: annotation {hint!r} has no JSON schema; use str, int, float, "
        "bool, list[...], dict[str, ...], Literal[...], or give the function a "
        "`schema` attribute"
    )


_ARGS_HEADER = re.compile(r"^(?:Args|Arguments|Parameters):[ \t]*$", re.MULTILINE)
_ARG_LINE = re.compile(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    parts = _ARGS_HEADER.split(doc, maxsplit=1)
    head, args = (parts[0], parts[1]) if len(parts) == 2 else (doc, "")
    params: dict[str, str] = {}
    indent, current = None, None
    for line in args.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break  # the next section (Returns:, Raises:, ...)
        if indent is None:
            indent = depth
        m = _ARG_LINE.fullmatch(line.strip())
        if depth == indent and m:
            current = m.group(1)
            params[current] = m.group(2).strip()
        elif current is not None:
            params[current] = f"{params[current]} {line.strip()}".strip()
    description = " ".join(head.strip().split("\n\n", 1)[0].split())
    return description, params


def function_schema(fn: Callable, name: str | None = None) -> dict[str, Any]:
    """The OpenAI `tools` entry of `fn`: its `schema` attribute (the entry itself, or just its
    `function` part), else one derived from the signature and docstring. TypeError / ValueError
    name what cannot be described."""
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
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise TypeError(f"{name}: cannot read its signature ({e})") from None
    description, docs = _docstring_parts(fn)
    properties: dict[str, Any] = {}
    required = []
    for p in signature.parameters.values():
        where = f"{name}({p.name})"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(
                f"{where}: tools take named arguments only (no *args, **kwargs or "
                "positional-only parameters)"
            )
        if p.name not in hints:
            raise TypeError(f"{where}: annotate the parameter's type (str, int, ...)")
        prop = _json_type(hints[p.name], where)
        if p.name in docs:
            prop["description"] = docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _import_tool(spec: str) -> Callable:
    module_name, attr = spec.split(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"{attr!r} is not callable")
    return fn


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
    except (TypeError, ValueError, jsonschema.SchemaError) as e:
        raise RecipeError(f"{field}={spec!r}: {str(e).splitlines()[0]}") from None
    return Tool(schema["function"]["name"], spec, schema)


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


# ------------------------------------------------------------------------------------ workers
def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _worker_main(conn, specs: list[str], max_output_chars: int) -> None:
    """A worker process: import the tools, then answer (name, arguments) requests forever.
    The tools' own prints go nowhere (they would interleave with the controller's output)."""
    from miles_like.run.orphans import exit_with_parent

    exit_with_parent()  # a tool that never returns must not outlive the controller
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    fns = {}
    for spec in specs:
        fn = _import_tool(spec)
        fns[function_schema(fn)["function"]["name"]] = fn
    conn.send(("ready", os.getpid()))
    while True:
        try:
            name, arguments = conn.recv()
        except EOFError:  # the pool closed its end
            return
        try:
            text = _as_text(fns[name](**arguments))
        except BaseException as e:  # noqa: BLE001 (SystemExit too: the worker lives on)
            conn.send(("raised", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]))
            continue
        # the cap is applied here, so an oversized output never crosses the pipe
        conn.send(("ok", text) if len(text) <= max_output_chars else ("flood", len(text)))


class _Worker(NamedTuple):
    process: multiprocessing.process.BaseProcess
    conn: Any  # multiprocessing.connection.Connection, the pool's end


def _kill(worker: _Worker) -> None:
    worker.conn.close()
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(timeout=10)


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
        self._validators = {t.name: jsonschema.Draft202012Validator(t.parameters) for t in tools}
        self._ctx = multiprocessing.get_context("spawn")
        self._specs = [t.spec for t in tools]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, ToolPool._kill_all, self._all)
        if tools:
            for w in [self._start() for _ in range(workers)]:
                self._await_ready(w)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI `tools` list, for the chat template."""
        return [t.schema for t in self.tools.values()]

    # --------------------------------------------------------------------------- processes
    def _start(self) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            name="miles_like-tool-worker",
            args=(theirs, self._specs, self.max_output_chars),
            daemon=True,
        )
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        with self._lock:
            self._all.add(worker)
        return worker

    def _await_ready(self, worker: _Worker) -> None:
        """Wait for a started worker's hello and make it available; RuntimeError if it never
        comes (a tool module that fails to import in a fresh interpreter)."""
        try:
            ok = worker.conn.poll(WORKER_START_TIMEOUT_S) and worker.conn.recv()[0] == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self._discard(worker)
            raise RuntimeError(
                f"a tool worker did not start within {WORKER_START_TIMEOUT_S} s "
                f"(tools {self._specs}); import them in a fresh interpreter to "
                "see why"
            )
        self._idle.put(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        _kill(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start its replacement in the background: the call that found it
        dead or hung returns at once."""
        self._discard(worker)
        if self._closed:
            return

        def restart():
            try:
                self._await_ready(self._start())
            except RuntimeError:
                pass  # callers waiting for a worker get "unavailable" after their timeout

        threading.Thread(target=restart, name="tool-worker-restart", daemon=True).start()

    @staticmethod
    def _kill_all(workers: set[_Worker]) -> None:
        for w in list(workers):
            _kill(w)
        workers.clear()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = set(self._all)
        ToolPool._kill_all(workers)
        with self._lock:
            self._all.clear()

    def __enter__(self) -> typing.Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------- calls
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
        try:  # every worker may be restarting after a hang: wait for one, boundedly
            worker = self._idle.get(timeout=self.timeout_s + WORKER_START_TIMEOUT_S)
        except queue.Empty:
            return ToolResult(f"error: no tool worker available for {name}", "unavailable")
        try:
            worker.conn.send((name, checked))
            if not worker.conn.poll(self.timeout_s):
                self._replace(worker)
                return ToolResult(f"error: {name} timed out after {self.timeout_s:g} s", "timeout")
            kind, payload = worker.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self._replace(worker)
            return ToolResult(
                f"error: {name} crashed its process (exit code {worker.process.exitcode})",
                "crashed",
            )
        self._idle.put(worker)
        if kind == "ok":
            return ToolResult(payload)
        if kind == "flood":
            return ToolResult(
                f"error: {name} returned {payload} characters, over the "
                f"{self.max_output_chars} limit",
                "flood",
            )
        return ToolResult(f"error: {name} raised {payload}", "raised")

    async def acall(self, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
        return await asyncio.to_thread(self.call, name, arguments)
