"""The local files a recipe names exist, and the user code it names imports: the model and data
paths, the draft model, the reward function, the tools, the checkpoint to resume; then the
checks against this machine (`preflight.py`). `--no-path-check` skips all of it (a recipe meant
for another machine)."""

from __future__ import annotations

from pathlib import Path

from miles_like.errors import RecipeError
from miles_like.recipe.recipe import Recipe


def check_paths(recipe: Recipe) -> None:
    """Local files the recipe names exist (and a user reward's module imports)."""
    if recipe.model.path is not None:
        p = Path(recipe.model.path).expanduser()
        if not p.is_dir():
            raise RecipeError(
                f"model.path={recipe.model.path!r}: no such directory; give a local "
                "Hugging Face model directory (or --no-path-check for a dry run)"
            )
        if not (p / "config.json").is_file():
            raise RecipeError(
                f"model.path={recipe.model.path!r} has no config.json; point it at "
                "a Hugging Face model directory"
            )
    draft = recipe.rollout.speculative_draft_model_path
    if draft is not None and not (Path(draft).expanduser() / "config.json").is_file():
        raise RecipeError(
            f"rollout.speculative_draft_model_path={draft!r}: no Hugging Face model directory "
            "(config.json) there; give the local directory of the draft model"
        )
    if recipe.data.path is not None and not Path(recipe.data.path).expanduser().is_file():
        raise RecipeError(
            f"data.path={recipe.data.path!r}: no such file; give a local .jsonl / "
            ".parquet file (or --no-path-check for a dry run)"
        )
    from miles_like.scoring.rewards import resolve_reward

    resolve_reward(recipe.reward.function)
    from miles_like.recipe.preflight import check_machine

    check_machine(recipe)
    from miles_like.rollouts.tools import load_tools

    load_tools(recipe.rollout.tools)
    if recipe.checkpoint.resume not in (False, "auto"):
        from miles_like.run.checkpoint import check_checkpoint_dir

        check_checkpoint_dir(Path(recipe.checkpoint.resume).expanduser(), "checkpoint.resume")
