"""The recipe: its sections and fields (`sections.py`), the `Recipe` that holds them
(`recipe.py`) and the rules across them (`rules.py`), overrides, loading and the resolved YAML
(`load.py`), the engine and trainer configs it builds (`build_configs.py`), the checks of the
files it names and of this machine (`paths.py`, `preflight.py`) and the command line (`cli.py`).

    from miles_like.recipe import load_recipe
    recipe = load_recipe("recipes/tiny_arith_grpo.yaml", ["rollout.n=4"])
"""

from miles_like.errors import RecipeError
from miles_like.recipe.load import load_recipe, recipe_to_yaml
from miles_like.recipe.recipe import Recipe

__all__ = ["Recipe", "RecipeError", "load_recipe", "recipe_to_yaml"]
