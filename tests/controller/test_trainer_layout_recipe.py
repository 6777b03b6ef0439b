"""The trainer's layout against the model, checked when the recipe loads (and in `--dry-run`),
not in a trainer actor after Ray started: `trainer.tp` must split the heads, KV heads and MLP
evenly (the built-in tiny-qwen2 has 4 heads and 2 KV heads) and a mixture's experts too, and a
mixture of experts trains at trainer PP 1 for now (the trainer's own build refuses the same:
`trainer.megatron_model.transformer_config`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe


def recipe(tmp_path: Path, builtin: str, *overrides: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model:\n  builtin: {builtin}\ndata:\n  synthetic: arith\n")
    return load_recipe(path, list(overrides))


@pytest.mark.parametrize(
    "builtin, overrides, message",
    [
        (
            "tiny-qwen3-moe",
            ("trainer.pp=2", "cluster.devices=2"),
            "trainer.pp=2 with the mixture of experts 'qwen3_moe' is not supported yet; "
            "set trainer.pp=1",
        ),
        (
            "tiny-qwen2",
            ("trainer.tp=4", "cluster.devices=4"),
            "trainer.tp=4 must divide the model's num_key_value_heads=2",
        ),
    ],
)
def test_layouts_the_trainer_cannot_build_are_one_line_at_load(
    tmp_path, builtin, overrides, message
):
    with pytest.raises(RecipeError) as e:
        recipe(tmp_path, builtin, *overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_layouts_the_trainer_builds_still_load(tmp_path):
    assert recipe(tmp_path, "tiny-qwen3-moe", "rollout.tp=2", "cluster.devices=2").rollout.tp == 2
    assert recipe(tmp_path, "tiny-qwen2", "trainer.tp=2", "cluster.devices=2").trainer.tp == 2
    # a mixture trains under trainer TP (experts split like the dense MLP)
    moe = recipe(tmp_path, "tiny-qwen3-moe", "trainer.tp=2", "rollout.tp=2", "cluster.devices=2")
    assert moe.trainer.tp == 2


def test_trainer_tp_must_divide_a_mixtures_expert_width(tmp_path, monkeypatch):
    from miles_like.recipe import preflight

    config = preflight.model_config(recipe(tmp_path, "tiny-qwen3-moe"))
    assert config["moe_intermediate_size"] % 2 == 0
    monkeypatch.setattr(
        preflight, "model_config", lambda r: {**config, "moe_intermediate_size": 33}
    )
    with pytest.raises(RecipeError) as e:
        recipe(tmp_path, "tiny-qwen3-moe", "trainer.tp=2", "cluster.devices=2")
    want = "trainer.tp=2 must divide the model's moe_intermediate_size=33; choose a divisor of it"
    assert str(e.value) == want
