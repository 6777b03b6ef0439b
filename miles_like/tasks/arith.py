"""Multi-digit arithmetic: the default task. Prompts like `"37+405="`, answers like `"442"`.

Generated on the fly from a seed: the same seed gives the same stream of problems on every
machine (Python's `random.Random` is specified to be reproducible across platforms).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

OPS = "+-*"


@dataclass(frozen=True)
class ArithSpec:
    digits: int = 2
    """Operands are drawn uniformly from [0, 10**digits)."""
    ops: str = "+-"
    """Operators to draw from, a subset of "+-*"."""

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"digits={self.digits!r}: use an int in [1, 9]")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops={self.ops!r}: use a non-empty subset of {OPS!r}, e.g. '+-'")


class ArithProblem(NamedTuple):
    prompt: str
    answer: str


def make_problem(rng: random.Random, spec: ArithSpec) -> ArithProblem:
    hi = 10**spec.digits - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    op = rng.choice(spec.ops)
    if op == "-" and b > a:
        a, b = b, a  # answers stay non-negative: one fewer thing for a tiny model to learn
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return ArithProblem(f"{a}{op}{b}=", str(value))


def problems(seed: int, spec: ArithSpec = ArithSpec()) -> Iterator[ArithProblem]:
    """An endless, seeded stream of problems."""
    rng = random.Random(seed)
    while True:
        yield make_problem(rng, spec)


_INTEGER = re.compile(r"\s*(-?\d+)\s*")


def score(response: str, answer: str) -> float:
    """1.0 when the whole response (surrounding whitespace aside) is the integer `answer`."""
    m = _INTEGER.fullmatch(response)
    return 1.0 if m is not None and int(m.group(1)) == int(answer) else 0.0
