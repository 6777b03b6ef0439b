"""Every shipped recipe validates; the tiny ones fully (paths included), the real-model ones with
--no-path-check (their model and data paths are the user's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_like.cli import main
from miles_like.recipe import RecipeError, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
NAMES = [p.name for p in RECIPES]


def test_the_documented_recipes_exist():
    assert {
        "tiny_arith_grpo.yaml",
        "tiny_arith_ppo.yaml",
        "tiny_arith_dapo.yaml",
        "qwen2.5-0.5b-gsm8k-grpo.yaml",
    } <= set(NAMES)


@pytest.mark.parametrize("path", RECIPES, ids=NAMES)
def test_recipe_dry_run(path, capsys):
    tiny = path.name.startswith("tiny_")
    args = [str(path), "--dry-run"] + ([] if tiny else ["--no-path-check"])
    assert main(args) == 0, capsys.readouterr().err


def test_tiny_recipes_say_what_they_claim():
    grpo = load_recipe(RECIPES[NAMES.index("tiny_arith_grpo.yaml")])
    ppo = load_recipe(RECIPES[NAMES.index("tiny_arith_ppo.yaml")])
    dapo = load_recipe(RECIPES[NAMES.index("tiny_arith_dapo.yaml")])
    assert (
        grpo.model.builtin and grpo.data.synthetic == "arith" and grpo.algorithm.advantage == "grpo"
    )
    assert ppo.algorithm.advantage == "gae"
    assert dapo.algorithm.dynamic_sampling and dapo.algorithm.clip_high > dapo.algorithm.clip_low
    assert dapo.algorithm.overlong_buffer > 0


def test_real_model_recipe_needs_its_paths():
    path = RECIPES[NAMES.index("qwen2.5-0.5b-gsm8k-grpo.yaml")]
    with pytest.raises(RecipeError, match="model.path"):
        load_recipe(path)
    r = load_recipe(path, check_paths_exist=False)
    assert r.reward.function == "math" and r.data.prompt_key == "question"
