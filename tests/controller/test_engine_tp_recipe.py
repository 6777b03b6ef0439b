"""`rollout.tp`: the recipe field, its one-line errors and its mapping onto the engine config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe
from miles_like.recipe.build_configs import engine_config
from miles_like.run.placement import plan

MINIMAL = "model:\n  builtin: tiny-qwen2\ndata:\n  synthetic: arith\n"  # 4 heads, 2 KV heads


def recipe(tmp_path: Path, *overrides: str, text: str = MINIMAL):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def test_rollout_tp_maps_onto_the_engine_and_the_placement(tmp_path):
    r = recipe(tmp_path, "rollout.tp=2", "trainer.tp=2", "cluster.devices=4")
    cfg = engine_config(r, "/m", "cpu")
    assert cfg.tp == 2 and cfg.attention_backend == "torch"
    # auto on CUDA is the Triton backend, but engine TP runs the torch one
    assert engine_config(r, "/m", "cuda").attention_backend == "torch"
    assert engine_config(recipe(tmp_path), "/m", "cuda").attention_backend == "triton"
    layout = plan(r.cluster, r.rollout.tp)
    assert layout.num_replicas == 2
    assert [layout.replica_bundles(i) for i in range(2)] == [[0, 1], [2, 3]]
    disagg = plan(
        recipe(
            tmp_path,
            "rollout.tp=2",
            "cluster.devices=3",
            "cluster.colocate=false",
            "cluster.rollout_devices=2",
        ).cluster,
        2,
    )
    assert disagg.num_replicas == 1 and disagg.replica_bundles(0) == [1, 2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("rollout.tp=2", "cluster.devices=3"), "rollout.tp=2 must divide the 3 engine devices"),
        (
            ("rollout.tp=2", "cluster.devices=3", "cluster.colocate=false"),
            "rollout.tp=2 must divide the 1 engine devices",
        ),
        (
            (
                "rollout.tp=2",
                "cluster.devices=2",
                "rollout.attention_backend=torch",
                "rollout.speculative_method=ngram",
            ),
            "rollout.speculative_method='ngram' is not supported with rollout.tp=2",
        ),
        (
            ("rollout.tp=2", "cluster.devices=2", "rollout.decode_graphs=true"),
            "rollout.decode_graphs=True is not supported with rollout.tp=2",
        ),
        (
            ("rollout.tp=2", "cluster.devices=2", "rollout.attention_backend=triton"),
            "rollout.attention_backend='triton' is not supported with rollout.tp=2",
        ),
        (
            ("rollout.tp=4", "cluster.devices=4"),
            "rollout.tp=4 must divide the model's num_key_value_heads=2",
        ),
        (("rollout.tp=0",), "rollout.tp"),
    ],
)
def test_rollout_tp_errors_are_one_line_naming_the_field(tmp_path, overrides, message):
    with pytest.raises(RecipeError) as e:
        recipe(tmp_path, *overrides)
    text = str(e.value)
    assert message in text and "\n" not in text


def test_heads_of_a_user_model_are_checked(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 8})
    )
    (model / "model.safetensors").write_bytes(b"")
    text = f"model:\n  path: {model}\ndata:\n  synthetic: arith\n"
    with pytest.raises(RecipeError, match="rollout.tp=2 must divide the model's num_key_value"):
        recipe(tmp_path, "rollout.tp=2", "cluster.devices=2", text=text)
