"""The chain task (`data.synthetic: chain`): answers are the prompt's running values (checked by
folding the prompt's operations with Python's arithmetic), lengths are the stated truncated
geometric distribution (chi-square test), the reward reads the value after `->`, and the recipe
fields are validated with one-line errors."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

import pytest
from scipy.stats import chisquare

from miles_like.data import PromptSource
from miles_like.models.tokenizer import builtin_tokenizer
from miles_like.recipe import RecipeError
from miles_like.recipe.sections import DataSection
from miles_like.scoring.rewards import BUILTIN_REWARDS
from miles_like.tasks.chain import ChainSpec, problems, score

ROOT = Path(__file__).resolve().parents[2]


def take(seed, spec, n=2000):
    return list(itertools.islice(problems(seed, spec), n))


def running_values(prompt: str) -> list[int]:
    assert prompt.endswith("=")
    start, *steps = re.findall(r"[-+*]?\d", prompt[:-1])
    value, out = int(start), []
    for step in steps:
        op, operand = step[0], int(step[1:])
        value = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
        out.append(value)
    return out


@pytest.mark.parametrize(
    "spec",
    [
        ChainSpec(),
        ChainSpec(20, 0.8, "+-*"),
        ChainSpec(1, 0.5, "-"),
        ChainSpec(16, 0.7, "+-*", max_value=9),
    ],
)
def test_answers_are_the_running_values(spec):
    for p in take(3, spec, 500):
        values = running_values(p.prompt)
        assert 1 <= len(values) <= spec.max_ops
        assert all(0 <= v <= spec.max_value for v in values)
        assert p.answer == f"{', '.join(map(str, values))} -> {values[-1]}"
        assert score(p.answer, p.answer) == 1.0


def test_operations_are_geometric_capped():
    spec = ChainSpec(max_ops=6, continue_p=0.6)
    counts = Counter(len(running_values(p.prompt)) for p in take(5, spec, 4000))
    p = spec.continue_p
    probs = [(1 - p) * p ** (k - 1) for k in range(1, spec.max_ops)] + [p ** (spec.max_ops - 1)]
    observed = [counts[k] for k in range(1, spec.max_ops + 1)]
    _, p_value = chisquare(observed, [4000 * q for q in probs])
    assert p_value > 1e-3, (observed, p_value)  # fails by chance once in a thousand seeds


def test_seeded():
    assert take(7, ChainSpec(), 50) == take(7, ChainSpec(), 50)
    assert take(7, ChainSpec(), 50) != take(8, ChainSpec(), 50)


def test_score_is_the_value_after_the_arrow():
    answer = "13, 15, 7, 13 -> 13"
    assert score("13, 15, 7, 13 -> 13", answer) == 1.0
    assert score("1, 2 -> 13 ", answer) == 1.0  # the final value is what is rewarded
    assert score("13, 15, 7, 13 -> 12", answer) == 0.0
    assert score("13", answer) == 0.0  # no arrow, no answer
    assert score("-> 13 x", answer) == 0.0
    assert BUILTIN_REWARDS["chain"]("p", "5 -> 5", "5 -> 5") == 1.0


def test_prompt_source_streams_chain_problems():
    data = DataSection(
        synthetic="chain", chain_max_ops=5, chain_continue_p=0.5, chain_ops="+*", chain_max_value=9
    )
    got = PromptSource(data, builtin_tokenizer(), seed=4, max_prompt_tokens=64).next_batch(30)
    want = take(4, ChainSpec(5, 0.5, "+*", 9), 30)
    assert [(g.prompt, g.answer) for g in got] == [(w.prompt, w.answer) for w in want]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chain_ops="/"), "data.chain_ops='/': use a non-empty subset of '+-*'"),
        (dict(chain_continue_p=1.0), "data.chain_continue_p"),
        (dict(chain_max_ops=0), "data.chain_max_ops"),
        (dict(chain_max_value=5), "data.chain_max_value"),
    ],
)
def test_bad_fields_name_themselves(kwargs, message):
    from miles_like.recipe import load_recipe

    overrides = [f"data.{k}={v}" for k, v in kwargs.items()]
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(str(ROOT / "recipes" / "tiny_chain_grpo.yaml"), overrides)
