"""The calculator task: the safe evaluator against Python's own arithmetic on random expression
trees, its refusals, and the warm start's demonstrations."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_like.tasks import arith, calc


def _render(tree) -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    if op == "neg":
        return f"-({_render(left)})"
    return f"({_render(left)}){op}({_render(right)})"


trees = st.recursive(
    st.integers(0, 10**6),
    lambda sub: st.tuples(st.sampled_from(["+", "-", "*", "neg"]), sub, sub),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(trees, st.sampled_from(["", " ", "  "]))
def test_evaluate_equals_python_arithmetic(tree, space):
    text = _render(tree).replace("(", f"({space}").replace("+", f"{space}+{space}")
    reference = eval(text, {"__builtins__": {}})  # the test's reference, on generated text only
    if len(text) <= calc.MAX_EXPRESSION_CHARS:
        assert calc.evaluate(text) == reference
        assert calc.calculator(text) == str(reference)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("2+", "ends too early"),
        ("(2+3", "not closed"),
        ("2)", "after a complete expression"),
        ("2 3", "after a complete expression"),
        ("2**3", "unexpected '*'"),
        ("7/2", "unexpected '/'"),
        ("1.5+1", "unexpected '.'"),
        ("__import__('os')", "unexpected '_'"),
        ("x", "unexpected 'x'"),
        ("1+" * 150 + "1", "longer than"),
        ("(" * 40 + "1" + ")" * 40, "nested"),
    ],
)
def test_evaluate_refuses_what_is_not_an_integer_expression(text, fragment):
    with pytest.raises(ValueError) as e:
        calc.evaluate(text)
    assert fragment in str(e.value), str(e.value)


def test_expression_of_a_prompt():
    for p in itertools.islice(arith.problems(3, arith.ArithSpec(3, "+-*")), 200):
        assert calc.evaluate(calc.expression(p)) == int(p.answer)


def test_demonstrations():
    tool_call, result, final = calc.demonstration("347*28=", "9716", ("calculator",))
    assert tool_call["role"] == "assistant" and tool_call["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "347*28"}},
        }
    ]
    assert result == {"role": "tool", "name": "calculator", "content": "9716"}
    assert final == {"role": "assistant", "content": "9716"}
    assert calc.demonstration("347*28=", "9716", ()) == [{"role": "assistant", "content": "9716"}]
