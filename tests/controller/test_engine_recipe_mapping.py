"""How the recipe sizes and configures the engine (build_configs.engine_config):

* `rollout.attention_backend: auto` never sends a float64 pool through the float32 Triton kernel
  (the torch backend on CUDA for float64), and an explicit `triton` with float64 is one line;
* `rollout.kv_memory_fraction` reaches the engine and is refused outside (0, 1];
* the engine's context (`EngineConfig.max_model_len`: its slot table, rotary tables and static
  decode buffers) is the run's longest sequence, the model's context capped by
  `trainer.max_tokens_per_micro_batch`, not the model's `max_position_embeddings`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe
from miles_like.recipe.build_configs import attention_backend, engine_config
from rollout import Engine, EngineConfig, SamplingParams

MINIMAL = "model:\n  builtin: tiny-qwen2\ndata:\n  synthetic: arith\n"


def recipe(tmp_path: Path, *overrides: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(MINIMAL)
    return load_recipe(path, list(overrides))


def test_auto_backend_is_torch_for_float64_on_cuda():
    assert attention_backend("auto", "cuda", "float64", 1) == "torch"
    assert attention_backend("auto", "cuda", "float32", 1) == "triton"
    assert attention_backend("auto", "cuda", "bfloat16", 1) == "triton"
    assert attention_backend("auto", "cuda", "bfloat16", 2) == "torch"  # engine TP
    assert attention_backend("auto", "cpu", "float32", 1) == "torch"
    assert attention_backend("torch", "cuda", "bfloat16", 1) == "torch"


def test_auto_backend_through_the_recipe(tmp_path):
    f64 = recipe(tmp_path, "model.dtype=float64")
    assert engine_config(f64, "/m", "cuda").attention_backend == "torch"
    assert engine_config(f64, "/m", "cuda").decode_graphs is None  # so: off (torch backend)
    assert engine_config(recipe(tmp_path), "/m", "cuda").attention_backend == "triton"


def test_triton_with_float64_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"EngineConfig.attention_backend='triton'") as error:
        EngineConfig(model_path="m", device="cuda", dtype="float64", attention_backend="triton")
    assert "'torch' for float64" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(RecipeError, match=r"rollout.attention_backend='triton'") as error:
        recipe(
            tmp_path,
            "model.dtype=float64",
            "rollout.attention_backend=triton",
            "cluster.accelerator=cuda",
        )
    assert "\n" not in str(error.value)


def test_kv_memory_fraction_reaches_the_engine(tmp_path):
    assert engine_config(recipe(tmp_path), "/m").kv_memory_fraction == 0.2  # the default
    r = recipe(tmp_path, "rollout.kv_memory_fraction=0.6")
    assert engine_config(r, "/m").kv_memory_fraction == 0.6
    assert (
        engine_config(recipe(tmp_path, "rollout.kv_memory_fraction=1"), "/m").kv_memory_fraction
        == 1
    )
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(RecipeError, match="rollout.kv_memory_fraction") as error:
            recipe(tmp_path, f"rollout.kv_memory_fraction={bad}")
        assert "\n" not in str(error.value)


def test_engine_context_follows_the_recipe_not_the_model(tmp_path, tiny_hf_checkpoints):
    model, directory = tiny_hf_checkpoints("qwen2")
    assert model.config.max_position_embeddings == 512
    r = recipe(
        tmp_path,
        "trainer.max_tokens_per_micro_batch=96",
        "rollout.max_new_tokens=8",
        "rollout.decode_graphs=true",
        "rollout.kv_cache_tokens=256",
        "rollout.page_size=16",
    )
    cfg = engine_config(r, str(directory), "cpu")
    assert cfg.max_model_len == 96
    engine = Engine(cfg)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engine.generate([[3, 5, 7, 11], [2, 4]], params)
    assert engine.decode_graphs.replays > 0
    assert engine.scheduler.slot_table.shape[1] == 96
    assert engine.model.rotary.cos.shape[0] == 96
    for static in engine.decode_graphs._static.values():
        assert static.page_table.shape[1] == 96 // 16 and static.bias.shape[-1] == 96
    # a model shorter than the micro-batch: its own context
    longer = recipe(tmp_path, "trainer.max_tokens_per_micro_batch=4096")
    assert engine_config(longer, str(directory), "cpu").max_model_len == 512


def test_fp8_kv_cache_reaches_the_engine_and_bad_pairs_are_one_line(tmp_path):
    assert engine_config(recipe(tmp_path), "/m").kv_cache_dtype == "auto"
    fp8 = recipe(tmp_path, "rollout.kv_cache_dtype=fp8_e4m3", "algorithm.is_correction=tis")
    assert engine_config(fp8, "/m").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(
        RecipeError, match=r"rollout.kv_cache_dtype='fp8_e4m3' with model.dtype="
    ) as error:
        recipe(
            tmp_path,
            "rollout.kv_cache_dtype=fp8_e4m3",
            "algorithm.is_correction=tis",
            "model.dtype=float64",
        )
    assert "'auto'" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(RecipeError, match=r"rollout.kv_cache_dtype") as error:
        recipe(tmp_path, "rollout.kv_cache_dtype=fp8")
    assert "\n" not in str(error.value)
    assert EngineConfig(model_path="m", kv_cache_dtype="fp8_e4m3", tp=2).tp == 2
    # the Triton kernels read an FP8 pool: auto keeps them on CUDA
    assert engine_config(fp8, "/m", "cuda").attention_backend == "triton"
