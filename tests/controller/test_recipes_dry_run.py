"""Every shipped recipe validates; the tiny ones fully (paths included), the real-model ones with
--no-path-check (their model and data paths are the user's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe
from miles_like.recipe.cli import main

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


def test_chain_learn_recipe_changes_only_what_it_says():
    """tiny_chain_learn_grpo.yaml is tiny_chain_grpo.yaml with the three changes its header
    names (and its own steps and output dir): the same long-tailed task, capped at 12 ops."""
    import dataclasses

    def fields(recipe, prefix=""):
        out = {}
        for f in dataclasses.fields(recipe):
            value = getattr(recipe, f.name)
            if dataclasses.is_dataclass(value):
                out |= fields(value, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = value
        return out

    base = fields(load_recipe(RECIPES[NAMES.index("tiny_chain_grpo.yaml")]))
    learn = fields(load_recipe(RECIPES[NAMES.index("tiny_chain_learn_grpo.yaml")]))
    changed = {key: learn[key] for key in base if base[key] != learn[key]}
    assert changed == {
        "steps": 60,
        "data.chain_continue_p": 0.3,
        "rollout.prompts_per_step": 32,
        "trainer.updates_per_rollout": 8,
        "tracking.output_dir": "outputs/tiny_chain_learn_grpo",
    }
    assert learn["data.chain_max_ops"] == 12
