"""Chains of operations (`data.synthetic: chain`): a long-tailed workload.

A prompt is a start digit and k operations, `"7+3*2-5="`; the answer shows every running value,
then the result: `"10, 20, 15 -> 15"`. k is drawn from a geometric distribution (one more
operation with probability `continue_p` after each, at most `max_ops`), so most answers are a
few tokens long and a few are many times longer: the last samples of a rollout decode at a tiny
batch while the rest wait, which is what `perf/rollout_tail_s` measures. The reward is exact
match of the value after `->`; the warm start demonstrates the step-by-step format (the answer
is the SFT target).

Values stay in [0, max_value]: an operand is at most max(value, max_value - value), so `+` or
`-` always fits, and an operation that would leave the range is replaced by one that does not
(`-` by `+` and vice versa, `*` by `+` or `-`). `max_value: 9` keeps every running value one
digit (learnable by the built-in tiny model), 99 gives two-digit values. Seeded with
`random.Random`, reproducible on every platform.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

OPS = "+-*"


@dataclass(frozen=True)
class ChainSpec:
    max_ops: int = 12
    """At most this many operations (the cap of the geometric distribution)."""
    continue_p: float = 0.6
    """Probability of one more operation after each: P(k) = (1 - p) p^(k - 1), mean 1 / (1 - p)."""
    ops: str = "+-"
    """Operators to draw from, a subset of "+-*"; operands are 1..9."""
    max_value: int = 99
    """Running values stay in [0, max_value]."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_ops, int) or not 1 <= self.max_ops <= 64:
            raise ValueError(f"max_ops={self.max_ops!r}: use an int in [1, 64]")
        if not 0.0 <= self.continue_p < 1.0:
            raise ValueError(f"continue_p={self.continue_p!r}: use a probability in [0, 1)")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops={self.ops!r}: use a non-empty subset of {OPS!r}, e.g. '+-'")
        if not isinstance(self.max_value, int) or not 9 <= self.max_value <= 9999:
            raise ValueError(f"max_value={self.max_value!r}: use an int in [9, 9999]")


class ChainProblem(NamedTuple):
    prompt: str
    answer: str  # the worked solution, "10, 20, 15 -> 15"


def _apply(value: int, op: str, operand: int, top: int) -> tuple[str, int]:
    """`op` applied, or the replacement that keeps the value in [0, top] (the operand is at
    most max(value, top - value), so `+` or `-` fits)."""
    if op == "*" and value * operand > top:
        op = "-" if value + operand > top else "+"
    if op == "+" and value + operand > top:
        op = "-"
    if op == "-" and operand > value:
        op = "+"
    return op, value + operand if op == "+" else value - operand if op == "-" else value * operand


def make_problem(rng: random.Random, spec: ChainSpec) -> ChainProblem:
    k = 1
    while k < spec.max_ops and rng.random() < spec.continue_p:
        k += 1
    value = rng.randint(0, 9)
    prompt, steps = [str(value)], []
    for _ in range(k):
        wanted, operand = rng.choice(spec.ops), rng.randint(1, 9)
        operand = min(operand, max(value, spec.max_value - value))
        op, value = _apply(value, wanted, operand, spec.max_value)
        prompt.append(f"{op}{operand}")
        steps.append(value)
    return ChainProblem("".join(prompt) + "=", f"{', '.join(map(str, steps))} -> {value}")


def problems(seed: int, spec: ChainSpec = ChainSpec()) -> Iterator[ChainProblem]:
    """An endless, seeded stream of problems."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng, spec)


_RESULT = re.compile(r"->\s*(-?\d+)\s*")


def final_value(text: str) -> int | None:
    """The integer after the last `->`, when the text ends with it (else None)."""
    at = text.rfind("->")
    m = _RESULT.fullmatch(text, at) if at >= 0 else None
    return int(m.group(1)) if m is not None else None


def score(response: str, answer: str) -> float:
    """1.0 when the response ends with `-> V` and V is the answer's result."""
    got = final_value(response)
    return 1.0 if got is not None and got == final_value(answer) else 0.0
