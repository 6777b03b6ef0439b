"""The recipe schema: loading, overrides, the resolved-YAML round trip, the mapping onto the
trainer / engine configs, and a table of malformed recipes (one line naming the field each)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from miles_like.recipe import Recipe, RecipeError, load_recipe, recipe_to_yaml
from miles_like.recipe.build_configs import engine_config, sampling_params, trainer_config
from miles_like.recipe.overrides import apply_overrides, parse_overrides

MINIMAL = "model:\n  builtin: tiny-qwen2\ndata:\n  synthetic: arith\n"


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_minimal_recipe_takes_documented_defaults(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL))
    assert r.model.builtin == "tiny-qwen2" and r.model.path is None
    assert r.data.synthetic == "arith" and r.data.chat_template is True
    assert (r.steps, r.seed, r.rollout.n, r.algorithm.advantage) == (100, 0, 8, "grpo")
    assert r.reward.function == "arith" and r.cluster.colocate is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.steps = 3


def test_overrides_are_yaml_scalars_and_create_sections(tmp_path):
    r = load_recipe(
        write(tmp_path, MINIMAL),
        [
            "rollout.n=4",
            "trainer.lr=1e-5",
            "algorithm.dual_clip=3",
            "cluster.address=null",
            "tracking.wandb_project=proj",
            "steps=7",
            "data.chat_template=false",
        ],
    )
    assert r.rollout.n == 4 and r.steps == 7 and r.data.chat_template is False
    # PyYAML reads "1e-5" as a string; a float field accepts it. An int becomes a float.
    assert r.trainer.lr == 1e-5 and isinstance(r.trainer.lr, float)
    assert r.algorithm.dual_clip == 3.0 and isinstance(r.algorithm.dual_clip, float)
    assert r.cluster.address is None and r.tracking.wandb_project == "proj"


def test_later_override_wins_and_source_mapping_is_not_mutated():
    data = {"rollout": {"n": 2}}
    out = apply_overrides(data, parse_overrides(["rollout.n=3", "rollout.n=5"]))
    assert out["rollout"]["n"] == 5 and data == {"rollout": {"n": 2}}


def test_resolved_yaml_loads_back_to_an_equal_recipe(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL), ["algorithm.advantage=rloo", "rollout.top_k=5"])
    again = load_recipe(write(tmp_path, recipe_to_yaml(r), "resolved.yaml"))
    assert again == r
    assert yaml.safe_load(recipe_to_yaml(r))["algorithm"]["advantage"] == "rloo"


def test_trainer_mapping(tmp_path):
    r = load_recipe(
        write(tmp_path, MINIMAL),
        [
            "steps=10",
            "trainer.updates_per_rollout=2",
            "trainer.tp=2",
            "trainer.pp=1",
            "cluster.devices=2",
            "trainer.lr=2e-5",
            "trainer.lr_schedule=cosine",
            "algorithm.clip_high=0.28",
            "algorithm.kl_coef=0.01",
            "algorithm.kl_type=k3",
            "algorithm.policy_loss=gspo",
            "algorithm.is_correction=tis",
            "rollout.temperature=0.7",
            "model.dtype=bfloat16",
            "trainer.backend=deepspeed",
        ],
    )
    cfg = trainer_config(r, "/m")
    assert cfg.model_path == "/m" and cfg.backend == "deepspeed" and cfg.dtype == "bfloat16"
    assert cfg.tp == 2 and cfg.pp == 1
    assert cfg.optim.lr == 2e-5 and cfg.optim.lr_schedule == "cosine"
    assert cfg.optim.total_steps == 20  # steps x updates_per_rollout optimizer steps
    assert cfg.loss.policy_loss == "gspo" and cfg.loss.clip_high == 0.28
    assert cfg.loss.kl_coef == 0.01 and cfg.loss.kl_type == "k3" and cfg.use_reference
    assert cfg.loss.is_correction == "tis" and cfg.loss.temperature == 0.7
    no_kl = trainer_config(load_recipe(write(tmp_path, MINIMAL)), "/m")
    assert no_kl.loss.policy_loss == "ppo" and not no_kl.use_reference


def test_engine_and_sampling_mapping(tmp_path):
    r = load_recipe(
        write(tmp_path, MINIMAL),
        [
            "rollout.kv_cache_tokens=512",
            "rollout.page_size=4",
            "rollout.n=3",
            "rollout.speculative_method=group",
            "rollout.max_new_tokens=9",
            "seed=5",
        ],
    )
    e = engine_config(r, "/m")
    assert (e.kv_cache_tokens, e.page_size, e.speculative_method, e.seed) == (512, 4, "group", 5)
    s = sampling_params(r, seed=11)
    assert (s.n, s.max_new_tokens, s.seed) == (3, 9, 11)


# (recipe text, overrides, what the message must contain). Each case is one kind of mistake.
MALFORMED = {
    "typo in key": (
        MINIMAL + "rollout:\n  temprature: 0.7\n",
        [],
        ["rollout.temprature", "did you mean rollout.temperature"],
    ),
    "typo in section": (
        MINIMAL + "algoritm:\n  kl_coef: 0.1\n",
        [],
        ["algoritm", "did you mean algorithm"],
    ),
    "typo in override": (
        MINIMAL,
        ["trainer.learning_rate=1e-5"],
        ["trainer.learning_rate", "did you mean trainer.lr?"],
    ),
    "unknown key, nothing close": (
        MINIMAL,
        ["rollout.zzz=1"],
        ["rollout.zzz", "valid keys of rollout are"],
    ),
    "wrong type": (MINIMAL + "rollout:\n  n: eight\n", [], ["rollout.n", "int"]),
    "bool for int": (MINIMAL, ["trainer.tp=true"], ["trainer.tp", "int"]),
    "string for bool": (MINIMAL, ["cluster.colocate=maybe"], ["cluster.colocate", "bool"]),
    "section is a scalar": (MINIMAL + "rollout: 5\n", [], ["rollout", "section"]),
    "out of range (schema)": (MINIMAL, ["algorithm.gamma=1.5"], ["algorithm.gamma", "[0.0, 1.0]"]),
    "out of range (engine's check)": (MINIMAL, ["rollout.top_p=1.5"], ["rollout.top_p", "(0, 1]"]),
    "out of range (sampling)": (
        MINIMAL,
        ["rollout.max_new_tokens=0"],
        ["rollout.max_new_tokens", "[1, inf)"],
    ),
    "zero temperature": (MINIMAL, ["rollout.temperature=0"], ["rollout.temperature", "(0.0"]),
    "bad enum": (MINIMAL, ["algorithm.advantage=ppo"], ["algorithm.advantage", "gae"]),
    "bad enum (trainer's check)": (
        MINIMAL,
        ["algorithm.kl_type=k9"],
        ["algorithm.kl_type", "low-var-kl"],
    ),
    "bad schedule (trainer's check)": (
        MINIMAL,
        ["trainer.lr_schedule=linear"],
        ["trainer.lr_schedule", "cosine"],
    ),
    "bad backend (trainer's check)": (
        MINIMAL,
        ["trainer.backend=fsdp"],
        ["trainer.backend", "deepspeed"],
    ),
    "float64 on deepspeed": (
        MINIMAL,
        ["model.dtype=float64", "trainer.backend=deepspeed"],
        ["model.dtype", "trainer.backend", "megatron"],
    ),
    "fp8 rollout without a correction": (
        MINIMAL,
        ["rollout.quantization=fp8"],
        ["rollout.quantization=fp8", "algorithm.is_correction: tis"],
    ),
    "fp8 rollout of a float64 model (engine's check)": (
        MINIMAL,
        ["rollout.quantization=fp8", "algorithm.is_correction=tis", "model.dtype=float64"],
        ["rollout.quantization='fp8'", "model.dtype='float64'", "bfloat16 or float32"],
    ),
    "fp8 KV cache without a correction": (
        MINIMAL,
        ["rollout.kv_cache_dtype=fp8_e4m3"],
        ["rollout.kv_cache_dtype=fp8_e4m3", "algorithm.is_correction: tis"],
    ),
    "unknown quantization": (MINIMAL, ["rollout.quantization=int4"], ["rollout.quantization"]),
    "bad int enum": (
        MINIMAL,
        ["cluster.off_policy_steps=2"],
        ["cluster.off_policy_steps", "0 | 1"],
    ),
    "bad reward spec": (
        MINIMAL,
        ["reward.function=my rewards"],
        ["reward.function", "module:function"],
    ),
    "unimportable reward": (
        MINIMAL,
        ["reward.function=no_such_module_xyz:score"],
        ["reward.function", "cannot import"],
    ),
    "missing model path": (
        MINIMAL.replace("builtin: tiny-qwen2", "path: /no/such/model"),
        [],
        ["model.path", "no such directory"],
    ),
    "missing data path": (
        MINIMAL.replace("synthetic: arith", "path: /no/such/data.jsonl"),
        [],
        ["data.path", "no such file"],
    ),
    "bad data suffix": (
        MINIMAL.replace("synthetic: arith", "path: data.csv"),
        [],
        ["data.path", ".parquet"],
    ),
    "draft without its model": (
        MINIMAL,
        ["rollout.speculative_method=draft"],
        ["rollout.speculative_method='draft'", "rollout.speculative_draft_model_path"],
    ),
    "missing draft model": (
        MINIMAL,
        ["rollout.speculative_method=draft", "rollout.speculative_draft_model_path=/no/such/draft"],
        ["rollout.speculative_draft_model_path", "config.json"],
    ),
    "draft path without draft": (
        MINIMAL,
        ["rollout.speculative_draft_model_path=/x"],
        ["rollout.speculative_draft_model_path", "rollout.speculative_method"],
    ),
    "both model sources": (MINIMAL, ["model.path=/x"], ["model.path", "model.builtin"]),
    "unknown builtin": (MINIMAL, ["model.builtin=gpt5"], ["model.builtin", "tiny-qwen2"]),
    "missing section": ("data:\n  synthetic: arith\n", [], ["model", "missing"]),
    "group estimator with n=1": (MINIMAL, ["rollout.n=1"], ["rollout.n", ">= 2"]),
    "overlong buffer too big": (
        MINIMAL,
        ["algorithm.overlong_buffer=64"],
        ["algorithm.overlong_buffer", "rollout.max_new_tokens"],
    ),
    "off-policy while colocated": (
        MINIMAL,
        ["cluster.off_policy_steps=1"],
        ["cluster.off_policy_steps", "cluster.colocate"],
    ),
    "devices vs tp": (MINIMAL, ["trainer.tp=2"], ["cluster.devices", "trainer.tp"]),
    "bad arith ops": (MINIMAL, ["data.arith_ops=/"], ["data.arith_ops='/': use", "+-*"]),
    "override without =": (MINIMAL, ["rollout.n"], ["rollout.n", "key=value"]),
    "override into a value": (MINIMAL, ["model.builtin.x=3"], ["model.builtin", "not a section"]),
    "override makes a value a mapping": (MINIMAL, ["steps.n=3"], ["steps", "int"]),
    "nan": (MINIMAL, ["trainer.lr=.nan"], ["trainer.lr", "nan"]),
    "top level not a mapping": ("- a\n- b\n", [], ["top level", "mapping"]),
    "yaml syntax": (MINIMAL + "rollout: {n: 3\n", [], ["invalid YAML", "line"]),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_recipe_one_line_naming_the_field(tmp_path, case):
    text, overrides, needles = MALFORMED[case]
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), overrides)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_empty_section_takes_defaults(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL + "rollout:\ncluster:\n"))
    assert r.rollout.n == 8 and r.cluster.devices == 1


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(tmp_path / "nope.yaml")


def test_path_checks_can_be_skipped_but_not_the_rest(tmp_path):
    text = MINIMAL.replace("builtin: tiny-qwen2", "path: /no/such/model")
    assert (
        load_recipe(write(tmp_path, text), check_paths_exist=False).model.path == "/no/such/model"
    )
    with pytest.raises(RecipeError, match="rollout.n"):
        load_recipe(write(tmp_path, text), ["rollout.n=x"], check_paths_exist=False)


def test_existing_paths_pass(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")  # only its presence is checked here
    data = write(tmp_path, '{"prompt": "1+1=", "answer": "2"}\n', "train.jsonl")
    r = load_recipe(write(tmp_path, f"model:\n  path: {model}\ndata:\n  path: {data}\n"))
    assert r.model.path == str(model) and r.data.path == str(data)
    (model / "config.json").unlink()
    with pytest.raises(RecipeError, match="model.path.*config.json"):
        load_recipe(write(tmp_path, f"model:\n  path: {model}\ndata:\n  path: {data}\n"))


def test_sections_validate_when_built_in_code():
    from miles_like.recipe.sections import RolloutSection

    with pytest.raises(RecipeError, match="rollout.prompts_per_step"):
        RolloutSection(prompts_per_step=0)
    r = Recipe(model={"builtin": "tiny-qwen2"}, data={"synthetic": "arith"})
    with pytest.raises(RecipeError, match="rollout.n"):
        dataclasses.replace(r, rollout=dataclasses.replace(r.rollout, n=1))


def test_fp8_rollout_reaches_the_engine_config(tmp_path):
    r = load_recipe(
        write(tmp_path, MINIMAL), ["rollout.quantization=fp8", "algorithm.is_correction=mis"]
    )
    assert engine_config(r, "/m").quantization == "fp8"
    assert engine_config(load_recipe(write(tmp_path, MINIMAL)), "/m").quantization is None


def test_engine_attention_backend_from_the_recipe(tmp_path, monkeypatch):
    """auto picks the Triton kernels (and so CUDA-graph decode) on CUDA, torch elsewhere; an
    explicit triton without CUDA fails validation with the reason; decode_graphs passes through."""
    r = load_recipe(write(tmp_path, MINIMAL), ["rollout.decode_graphs=true"])
    assert engine_config(r, "m", "cpu").attention_backend == "torch"
    gpu = engine_config(r, "m", "cuda")
    assert gpu.attention_backend == "triton" and gpu.decode_graphs is True
    assert (
        engine_config(
            load_recipe(write(tmp_path, MINIMAL), ["rollout.attention_backend=torch"]), "m", "cuda"
        ).attention_backend
        == "torch"
    )
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(RecipeError, match=r"^rollout\.attention_backend='triton' needs a CUDA"):
        load_recipe(write(tmp_path, MINIMAL), ["rollout.attention_backend=triton"])


def test_zero3_with_colocated_gpu_offload_is_refused(tmp_path, monkeypatch):
    zero3 = ["trainer.backend=deepspeed", "trainer.zero_stage=3"]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(RecipeError, match=r"^trainer\.zero_stage=3: colocated on GPU"):
        load_recipe(write(tmp_path, MINIMAL), zero3, check_paths_exist=False)
    # disaggregated it can run (no offload between phases)
    load_recipe(
        write(tmp_path, MINIMAL),
        [*zero3, "cluster.colocate=false", "cluster.devices=2"],
        check_paths_exist=False,
    )
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    load_recipe(write(tmp_path, MINIMAL), zero3)  # on CPU nothing is offloaded


def test_trainer_compile_reaches_the_trainer_config_megatron_only(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL), ["trainer.compile=true"])
    assert trainer_config(r, "/m").compile is True
    assert trainer_config(load_recipe(write(tmp_path, MINIMAL)), "/m").compile is False
    with pytest.raises(RecipeError, match="trainer.compile.*megatron"):
        load_recipe(write(tmp_path, MINIMAL), ["trainer.compile=true", "trainer.backend=deepspeed"])


def test_moe_aux_loss_coeff_reaches_the_trainer_config_megatron_only(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL), ["trainer.moe_aux_loss_coeff=0.01"])
    assert trainer_config(r, "/m").moe_aux_loss_coeff == 0.01
    assert trainer_config(load_recipe(write(tmp_path, MINIMAL)), "/m").moe_aux_loss_coeff == 0.0
    deepspeed = ["trainer.moe_aux_loss_coeff=0.01", "trainer.backend=deepspeed"]
    with pytest.raises(RecipeError, match=r"^trainer\.moe_aux_loss_coeff > 0 runs on .*megatron"):
        load_recipe(write(tmp_path, MINIMAL), deepspeed)
    with pytest.raises(RecipeError, match=r"^trainer\.moe_aux_loss_coeff") as caught:
        load_recipe(write(tmp_path, MINIMAL), ["trainer.moe_aux_loss_coeff=-1"])
    assert "\n" not in str(caught.value)


def test_renamed_field_is_accepted_for_one_release_with_a_warning(tmp_path):
    """`algorithm.gspo` (a bool) became `algorithm.policy_loss: ppo | gspo`: the old spelling
    still loads, warns in one line, and maps onto the new field."""
    path = write(tmp_path, MINIMAL)
    warning = r"^algorithm\.gspo is deprecated; write algorithm\.policy_loss: gspo instead"
    with pytest.warns(FutureWarning, match=warning) as caught:
        r = load_recipe(path, ["algorithm.gspo=true"])
    assert all("\n" not in str(w.message) for w in caught)
    assert r.algorithm.policy_loss == "gspo" and trainer_config(r, "/m").loss.policy_loss == "gspo"
    assert "gspo" not in yaml.safe_load(recipe_to_yaml(r))["algorithm"]  # written the new way
    with pytest.warns(FutureWarning, match=r"write algorithm\.policy_loss: ppo instead"):
        assert load_recipe(path, ["algorithm.gspo=false"]).algorithm.policy_loss == "ppo"
    both = ["algorithm.gspo=true", "algorithm.policy_loss=gspo"]
    with pytest.raises(RecipeError, match=r"^algorithm\.gspo is the former name of algorithm\."):
        load_recipe(path, both)
    with pytest.raises(RecipeError, match=r"^algorithm\.gspo=3: expected true or false"):
        load_recipe(path, ["algorithm.gspo=3"])
