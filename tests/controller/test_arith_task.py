"""The synthetic arithmetic task: seeded, correct (checked with Python's own arithmetic),
bounded."""

from __future__ import annotations

import itertools

import pytest

from miles_like.tasks.arith import ArithSpec, problems, score


def take(seed, spec, n=300):
    return list(itertools.islice(problems(seed, spec), n))


def test_answers_are_the_arithmetic_of_the_prompt():
    for spec in (ArithSpec(2, "+"), ArithSpec(3, "+-*"), ArithSpec(1, "-")):
        for p in take(1, spec):
            assert p.prompt.endswith("=")
            a, op, b = _split(p.prompt[:-1])
            assert op in spec.ops
            assert 0 <= a < 10**spec.digits and 0 <= b < 10**spec.digits
            expect = {"+": a + b, "-": a - b, "*": a * b}[op]
            assert p.answer == str(expect) and expect >= 0


def _split(expr):
    for i, ch in enumerate(expr):
        if ch in "+-*" and i > 0:
            return int(expr[:i]), ch, int(expr[i + 1 :])
    raise AssertionError(expr)


def test_seeded_and_varied():
    spec = ArithSpec(3, "+-*")
    assert take(7, spec) == take(7, spec)
    assert take(7, spec) != take(8, spec)
    assert len({p.prompt for p in take(7, spec)}) > 250  # not a short cycle
    ops = {ch for p in take(7, spec) for ch in p.prompt if ch in "+-*"}
    assert ops == {"+", "-", "*"}


def test_score():
    assert score("442", "442") == 1.0
    assert score("\n442 ", "442") == 1.0
    assert score("441", "442") == 0.0
    assert score("4 42", "442") == 0.0
    assert score("-3", "-3") == 1.0


@pytest.mark.parametrize("kwargs", [dict(digits=0), dict(digits=10), dict(ops=""), dict(ops="/")])
def test_bad_spec(kwargs):
    with pytest.raises(ValueError):
        ArithSpec(**kwargs)
