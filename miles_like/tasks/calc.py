"""The calculator task (`data.synthetic: calc`): multi-digit arithmetic that a tiny model cannot
do in its head, and a `calculator` tool that can.

The problems are the arithmetic task's (`arith.py`: prompts like `"347*28="`, answers like
`"9716"`, the same seeded stream); with `rollout.tools` naming `calculator` the warm start
demonstrates the whole conversation (a tool call with the prompt's expression, the tool's
result, the result as the final answer), without tools it demonstrates the bare answer. The
reward is the arithmetic task's exact match of the final answer.

`calculator` evaluates integer expressions with + - * and parentheses by a small recursive-
descent parser: no `eval`, bounded input length and nesting (a result has at most as many
digits as the expression has characters, so the work is bounded too).
"""

from __future__ import annotations

import re
from typing import Any

from miles_like.tasks.arith import ArithProblem

TOOL_SPEC = "miles_like.tasks.calc:calculator"
MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32  # nested parentheses / unary minus

_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*()]))")


def _tokens(expression: str) -> list[str]:
    out, pos = [], 0
    text = expression.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(
                f"unexpected {text[pos:].lstrip()[:1]!r} at position {pos}; use "
                "integers, + - * and parentheses"
            )
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


class _Parser:
    """expr := term (('+' | '-') term)*;  term := factor ('*' factor)*;
    factor := INT | '-' factor | '(' expr ')'"""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ValueError("the expression ends too early")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = value + self.term(depth) if self.take() == "+" else value - self.term(depth)
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        while self.peek() == "*":
            self.take()
            value *= self.factor(depth)
        return value

    def factor(self, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ValueError(f"more than {MAX_DEPTH} nested parentheses or signs")
        tok = self.take()
        if tok.isdigit():
            return int(tok)
        if tok == "-":
            return -self.factor(depth + 1)
        if tok == "(":
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ValueError("a '(' is not closed")
            self.take()
            return value
        raise ValueError(f"unexpected {tok!r}; expected a number, '-' or '('")


def evaluate(expression: str) -> int:
    """The value of an integer expression over + - * and parentheses; ValueError otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(_tokens(expression))
    if parser.peek() is None:
        raise ValueError("the expression is empty")
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression exactly.

    Args:
        expression: integers with + - * and parentheses, e.g. 347*28
    """
    return str(evaluate(expression))


def expression(problem: ArithProblem | str) -> str:
    """The expression a prompt asks for: `"347*28="` -> `"347*28"`."""
    prompt = problem if isinstance(problem, str) else problem.prompt
    return prompt.strip().removesuffix("=").strip()


def demonstration(prompt: str, answer: str, tool_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The messages after the user's prompt that solve it: with the calculator among the tools a
    tool call, its result and the final answer; otherwise the bare answer."""
    if "calculator" not in tool_names:
        return [{"role": "assistant", "content": answer}]
    arguments = {"expression": expression(prompt)}
    return [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
            ],
        },
        {"role": "tool", "name": "calculator", "content": calculator(**arguments)},
        {"role": "assistant", "content": answer},
    ]
