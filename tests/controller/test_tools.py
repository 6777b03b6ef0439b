"""Tools in worker processes (`miles_like/rollouts/`: `tools.py`, `tool_schema.py`,
`tool_pool.py`): schemas from signatures, argument validation, and every way a tool can
misbehave (raise, hang, crash, flood, bad arguments, unknown name) turning into an error string
and a counted kind, never into a stalled caller. Every misbehaviour test bounds its own wall
time."""

from __future__ import annotations

import asyncio
import time

import jsonschema
import psutil
import pytest

from miles_like.recipe import RecipeError
from miles_like.rollouts.tools import ToolPool, ToolResult, function_schema, load_tool, load_tools

TIMEOUT_S = 1.0
SPECS = [
    "user_tools:add",
    "user_tools:pid",
    "user_tools:shout",
    "user_tools:echo",
    "user_tools:hang",
    "user_tools:spin",
    "user_tools:exit_hard",
    "user_tools:segfault",
    "user_tools:flood",
    "user_tools:chatty",
    "user_tools:boom",
    "user_tools:leave",
]


@pytest.fixture(scope="module")
def pool():
    with ToolPool(load_tools(SPECS), workers=2, timeout_s=TIMEOUT_S, max_output_chars=100) as p:
        yield p


def test_schema_from_signature_and_docstring():
    """transformers' schema (`get_json_schema`): the whole description before `Args:`, every
    argument's description, the return's, an optional argument `nullable`."""
    import user_tools

    assert function_schema(user_tools.add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.\n\nThen multiply by a scale.",
            "parameters": {
                "type": "object",
                "required": ["a", "b"],
                "properties": {
                    "a": {"type": "integer", "description": "the first addend"},
                    "b": {
                        "type": "integer",
                        "description": "the second addend, which may be negative",
                    },
                    "scale": {"type": "number", "description": "a factor applied to the sum"},
                },
            },
            "return": {"type": "string", "description": "The scaled sum, as text."},
        },
    }
    shout = function_schema(user_tools.shout)["function"]["parameters"]["properties"]
    assert shout == {
        "word": {"type": "string", "description": "the word"},
        "style": {"type": "string", "enum": ["upper", "title"], "description": "how to write it"},
        "tags": {
            "type": "array",
            "items": {"type": "string"},
            "nullable": True,
            "description": "labels returned with it",
        },
    }


def test_the_chat_template_renders_the_schema_transformers_renders_for_the_function():
    """`apply_chat_template(tools=[fn])` derives the schema itself (`get_json_schema`); ours
    renders the same prompt, token for token."""
    import user_tools

    from miles_like.models.tokenizer import builtin_tokenizer

    tok = builtin_tokenizer().tok
    messages = [{"role": "user", "content": "add 2 and 3"}]
    for fn in (user_tools.add, user_tools.shout, user_tools.flood):
        assert tok.apply_chat_template(messages, tools=[function_schema(fn)], tokenize=False) == (
            tok.apply_chat_template(messages, tools=[fn], tokenize=False)
        )


def test_arguments_are_checked_as_json_schema():
    """A nullable argument may be null, an enum holds, the signature's arguments are all."""
    tool = load_tool("user_tools:shout")
    validator = jsonschema.Draft202012Validator(tool.arguments)
    assert validator.is_valid({"word": "a", "tags": None})
    assert validator.is_valid({"word": "a", "style": "title", "tags": ["x"]})
    assert not validator.is_valid({"word": "a", "style": "bold"})
    assert not validator.is_valid({"word": "a", "tags": [1]})
    assert not validator.is_valid({"word": "a", "colour": "red"})
    assert not validator.is_valid({"tags": None})


def test_explicit_schema_attribute_wins():
    import user_tools

    entry = function_schema(user_tools.echo)
    assert entry["type"] == "function" and entry["function"] == user_tools.echo.schema


@pytest.mark.parametrize(
    "spec, message",
    [
        ("calculator", "module:function"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("user_tools:missing", "has no 'missing'"),
        ("user_tools:untyped", "untyped(x): annotate"),
        ("user_tools:star", "named arguments only"),
        ("user_tools:undocumented", "no description for the argument 'x'"),
    ],
)
def test_bad_tool_specs_are_one_line_recipe_errors(spec, message):
    with pytest.raises(RecipeError, match="rollout.tools") as e:
        load_tool(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_duplicate_tool_names_are_refused():
    with pytest.raises(RecipeError, match=r"rollout.tools\[1\].*second tool named 'add'"):
        load_tools(["user_tools:add", "user_tools:add"])


def test_calls_return_the_tools_output(pool):
    assert pool.call("add", {"a": 2, "b": 3}) == ToolResult("5.0")
    assert pool.call("add", '{"a": 2, "b": -3, "scale": 2.5}') == ToolResult("-2.5")
    assert pool.call("shout", {"word": "hi", "style": "title"}) == ToolResult(
        '{"word": "Hi", "tags": []}'
    )
    assert pool.call("echo", {"text": "a"}) == ToolResult("[('text', 'a')]")
    assert pool.call("shout", {"word": "hi", "tags": None}) == ToolResult(
        '{"word": "HI", "tags": []}'
    )


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        ({"a": "two", "b": 3}, "a: 'two' is not of type 'integer'"),
        ({"a": True, "b": 3}, "a: True is not of type 'integer'"),
        ({"a": 1}, "'b' is a required property"),
        ({"a": 1, "b": 2, "c": 3}, "'c' was unexpected"),
    ],
)
def test_bad_arguments_are_an_error_result(pool, arguments, fragment):
    result = pool.call("add", arguments)
    assert result.error == "bad_args" and fragment in result.content, result


def test_unknown_tool(pool):
    result = pool.call("subtract", {"a": 1})
    assert result.error == "unknown" and "'subtract'" in result.content and "add" in result.content


def test_a_raising_tool_keeps_its_worker(pool):
    before = {pool.call("pid", {}).content for _ in range(6)}
    assert pool.call("boom", {}) == ToolResult(
        "error: boom raised ValueError: boom at the tool", "raised"
    )
    assert pool.call("leave", {}).error == "raised"  # sys.exit inside a tool
    after = {pool.call("pid", {}).content for _ in range(6)}
    assert after == before


@pytest.mark.parametrize("name", ["hang", "spin"])
def test_a_hanging_tool_times_out_and_its_worker_is_replaced(pool, name):
    pids = {pool.call("pid", {}).content for _ in range(6)}
    start = time.perf_counter()
    result = pool.call(name, {})
    elapsed = time.perf_counter() - start
    assert result == ToolResult(f"error: {name} timed out after {TIMEOUT_S:g} s", "timeout")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0
    # the pool keeps serving (the other worker at once, the replacement once it is up)
    start = time.perf_counter()
    assert pool.call("add", {"a": 1, "b": 1}) == ToolResult("2.0")
    assert time.perf_counter() - start < TIMEOUT_S
    deadline = time.monotonic() + 60
    while not (seen := {pool.call("pid", {}).content for _ in range(6)}) - pids:
        assert time.monotonic() < deadline, "the hung worker was not replaced"
        time.sleep(0.05)
    assert len(seen) == 2 and len(seen & pids) == 1  # one survivor, one replacement


@pytest.mark.parametrize("name", ["exit_hard", "segfault"])
def test_a_crashing_tool_is_an_error_result(pool, name):
    start = time.perf_counter()
    result = pool.call(name, {})
    assert result.error == "crashed" and "crashed its process" in result.content, result
    assert time.perf_counter() - start < TIMEOUT_S + 2.0
    assert pool.call("add", {"a": 1, "b": 1}) == ToolResult("2.0")


def test_exit_code_is_reported(pool):
    assert (
        pool.call("exit_hard", {"code": 7}).content == "error: exit_hard crashed its process "
        "(exit code 7)"
    )


def test_flooding_output_is_refused_at_the_cap(pool):
    assert pool.call("flood", {"n": 100}) == ToolResult("x" * 100)
    start = time.perf_counter()
    result = pool.call("flood", {"n": 50_000_000})
    assert result == ToolResult(
        "error: flood returned 50000000 characters, over the 100 limit", "flood"
    )
    assert time.perf_counter() - start < TIMEOUT_S + 2.0


def test_a_tools_prints_do_not_reach_the_caller(pool, capfd):
    assert pool.call("chatty", {}) == ToolResult("quiet answer")
    out, err = capfd.readouterr()
    assert "noise" not in out + err


def test_a_hang_does_not_stall_concurrent_calls(pool):
    async def main():
        hung = asyncio.create_task(pool.acall("hang", {}))
        start = time.perf_counter()
        quick = [await pool.acall("add", {"a": i, "b": 0}) for i in range(5)]
        quick_s = time.perf_counter() - start
        return await hung, quick, quick_s

    start = time.perf_counter()
    hung, quick, quick_s = asyncio.run(main())
    assert hung.error == "timeout"
    assert [r.content for r in quick] == ["0.0", "1.0", "2.0", "3.0", "4.0"]
    assert quick_s < TIMEOUT_S  # served by the other worker while the hang runs
    assert time.perf_counter() - start < TIMEOUT_S + 2.0


def test_close_ends_every_worker():
    pool = ToolPool(load_tools(["user_tools:pid"]), workers=2, timeout_s=TIMEOUT_S)
    processes = [psutil.Process(pid) for pid in pool.pids()]
    assert len(processes) == 2 and all(p.is_running() for p in processes)
    pool.close()
    assert not any(p.is_running() for p in processes)
