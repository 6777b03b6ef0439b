"""The shared config.json parser (`model_spec`) against Hugging Face transformers, the arbiter:
every config is written to a directory and read back with `AutoConfig.from_pretrained` (the
path a checkpoint takes), and the HF model built from it is the reference for the projections'
biases, the head layout and the RoPE tables (its rotary module's `inv_freq` and
`attention_scaling`).

The engine and the trainer used to parse config.json each on its own and disagreed on three
cases; each has a test here with the one behaviour chosen, HF's:

* llama3 RoPE without low/high_freq_factor: the engine defaulted them, the trainer refused;
  transformers refuses (KeyError), so do we. Without original_max_position_embeddings
  transformers takes max_position_embeddings (the engine took 8192, the trainer refused);
* `rope_scaling` next to `rope_parameters`: the engine merged them key by key, the trainer read
  only `rope_parameters`; transformers reads `rope_scaling` whole in its place;
* `mlp_bias` / `use_sliding_window`: the engine accepted both silently, the trainer refused
  both; transformers builds an MLP bias in Llama only (Qwen2 / Qwen3 ignore the key), and a
  sliding window only on Qwen2 / Qwen3 layers from `max_window_layers` on (we refuse those).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from model_spec import ModelSpec, RopeSpec, UnsupportedModelError

from tiny_hf import FAMILIES

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=5e5,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # transformers warns about unusual (but valid) RoPE values in these small configs
    logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_read(cfg: dict, tmp_path):
    """(transformers' config, the HF model built from it) for this config.json dict."""
    import transformers

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return config, model


def assert_same_as_hf(spec: ModelSpec, cfg: dict, tmp_path, max_positions: int = 64):
    config, model = hf_read(cfg, tmp_path)
    attn = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    assert spec.num_heads == config.num_attention_heads
    assert spec.num_kv_heads == config.num_key_value_heads
    assert spec.head_dim == attn.head_dim
    assert spec.max_position_embeddings == config.max_position_embeddings
    assert spec.rms_norm_eps == config.rms_norm_eps
    assert spec.tie_word_embeddings == config.tie_word_embeddings
    assert spec.qkv_bias == (attn.q_proj.bias is not None) == (attn.v_proj.bias is not None)
    assert spec.o_bias == (attn.o_proj.bias is not None)
    assert spec.mlp_bias == (mlp.gate_proj.bias is not None) == (mlp.down_proj.bias is not None)
    assert spec.qk_norm == hasattr(attn, "q_norm")
    rotary = model.model.rotary_emb
    torch.testing.assert_close(
        spec.rope.inv_freq(spec.head_dim), rotary.inv_freq.float(), atol=0, rtol=1e-6
    )
    assert spec.rope.attention_scaling == rotary.attention_scaling
    # the cos / sin the HF model applies at each position, from our inverse frequencies
    positions = torch.arange(max_positions)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    angles = torch.outer(positions[0].float(), spec.rope.inv_freq(spec.head_dim))
    emb = torch.cat((angles, angles), -1) * spec.rope.attention_scaling
    torch.testing.assert_close(cos[0], emb.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0], emb.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_test_families_read_as_transformers_reads_them(family, tmp_path):
    cfg = FAMILIES[family]
    assert_same_as_hf(ModelSpec.from_hf(cfg), cfg, tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_keys_left_out_take_transformers_defaults(family, tmp_path):
    """max_position_embeddings, num_key_value_heads, head_dim, rms_norm_eps, tie_word_embeddings,
    the RoPE theta: each family's own defaults (Qwen3's head_dim is 128, not hidden / heads)."""
    cfg = dict(BASE, model_type=family, num_attention_heads=32)
    del cfg["num_key_value_heads"]
    cfg["hidden_size"] = 256
    spec = ModelSpec.from_hf(cfg)
    assert_same_as_hf(spec, cfg, tmp_path)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 12345.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e4, "factor": 4.0}},
        {"rope_theta": 5e4, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_parameters": LLAMA3},
        {"rope_theta": 5e5, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}},
        {"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 777.0}},
    ],
    ids=[
        "theta",
        "default",
        "linear",
        "linear-tf4",
        "llama3",
        "llama3-tf4",
        "theta-inside-wins",
    ],
)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_kinds_and_layouts_match_transformers(family, rope, tmp_path):
    cfg = dict(BASE, model_type=family, max_position_embeddings=512, **rope)
    assert_same_as_hf(ModelSpec.from_hf(cfg), cfg, tmp_path, max_positions=512)


def test_inv_freq_in_float64_is_the_float32_values_refined():
    """A float64 model's tables are computed in float64 (exact to float64), close to HF's."""
    for rope in (
        RopeSpec(5e5),
        RopeSpec(1e4, "linear", 4.0),
        ModelSpec.from_hf(
            dict(BASE, model_type="llama", max_position_embeddings=512, rope_parameters=LLAMA3)
        ).rope,
    ):
        f64 = rope.inv_freq(16, torch.float64)
        assert f64.dtype == torch.float64
        torch.testing.assert_close(f64.float(), rope.inv_freq(16), atol=0, rtol=1e-6)


# ------------------------------------------------------------- where the two parsers disagreed
def test_llama3_without_its_factors_is_refused_as_transformers_refuses_it(tmp_path):
    import transformers

    params = {k: v for k, v in LLAMA3.items() if k not in ("low_freq_factor", "high_freq_factor")}
    cfg = dict(BASE, model_type="llama", rope_parameters=params)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="low_freq_factor"):
        transformers.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        ModelSpec.from_hf(cfg)
    message = str(e.value)
    assert "rope_parameters" in message and "low_freq_factor, high_freq_factor" in message
    assert "\n" not in message


def test_llama3_without_its_original_length_takes_max_position_embeddings(tmp_path):
    params = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = dict(BASE, model_type="llama", max_position_embeddings=256, rope_parameters=params)
    spec = ModelSpec.from_hf(cfg)
    assert spec.rope.original_max_position_embeddings == 256
    assert_same_as_hf(spec, cfg, tmp_path, max_positions=256)


def test_rope_scaling_next_to_rope_parameters_is_read_in_its_place(tmp_path):
    """transformers takes a non-empty `rope_scaling` whole (theta: its own, else the top-level
    one, else 10000); the engine merged the two dicts key by key, the trainer read only
    `rope_parameters` (which would say default RoPE with theta 777 here)."""
    cfg = dict(
        BASE,
        model_type="llama",
        rope_scaling={"type": "linear", "factor": 2.0},
        rope_parameters={"rope_type": "default", "rope_theta": 777.0},
    )
    spec = ModelSpec.from_hf(cfg)
    assert spec.rope == RopeSpec(10000.0, "linear", 2.0)
    assert_same_as_hf(spec, cfg, tmp_path)


def test_mlp_bias_is_llamas_only(tmp_path):
    llama = dict(BASE, model_type="llama", mlp_bias=True)
    assert ModelSpec.from_hf(llama).mlp_bias
    assert_same_as_hf(ModelSpec.from_hf(llama), llama, tmp_path / "llama")
    for family in ("qwen2", "qwen3"):  # their MLPs have no bias whatever the key says
        cfg = dict(BASE, model_type=family, mlp_bias=True)
        assert not ModelSpec.from_hf(cfg).mlp_bias
        assert_same_as_hf(ModelSpec.from_hf(cfg), cfg, tmp_path / family)


def test_attention_bias_per_family(tmp_path):
    for family in ("llama", "qwen2", "qwen3"):
        cfg = dict(BASE, model_type=family, attention_bias=True)
        assert_same_as_hf(ModelSpec.from_hf(cfg), cfg, tmp_path / family)


def test_sliding_window_layers_are_refused(tmp_path):
    import transformers

    cfg = dict(
        BASE, model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert transformers.AutoConfig.from_pretrained(tmp_path).layer_types == [
        "full_attention",
        "sliding_attention",
    ]
    with pytest.raises(UnsupportedModelError, match=r"use_sliding_window=true puts layers \[1\]"):
        ModelSpec.from_hf(cfg)
    explicit = dict(cfg, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match=r"layers \[0\]"):
        ModelSpec.from_hf(explicit)


@pytest.mark.parametrize(
    "extra, family",
    [
        # the switch on, but every layer below max_window_layers: all full attention
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), "qwen2"),
        (dict(use_sliding_window=True, sliding_window=None), "qwen3"),
        (dict(use_sliding_window=False, sliding_window=16, max_window_layers=0), "qwen2"),
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "llama"),
    ],
)
def test_sliding_window_keys_that_leave_every_layer_full_are_accepted(extra, family, tmp_path):
    cfg = dict(BASE, model_type=family, **extra)
    spec = ModelSpec.from_hf(cfg)
    config, _ = hf_read(cfg, tmp_path)
    assert set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    assert_same_as_hf(spec, cfg, tmp_path)


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "'dyn"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling rope type 'long"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "lacks factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
    ],
)
def test_refusals_are_one_line_naming_the_key(extra, needle):
    cfg = {**BASE, "model_type": "llama", **extra}
    with pytest.raises(UnsupportedModelError) as e:
        ModelSpec.from_hf(cfg)
    assert needle in str(e.value) and str(e.value).startswith("config.json")
    assert "\n" not in str(e.value)


def test_eos_ids_from_generation_config_first():
    cfg = dict(BASE, model_type="qwen2", eos_token_id=5)
    assert ModelSpec.from_hf(cfg).eos_token_ids == (5,)
    assert ModelSpec.from_hf(cfg, {"eos_token_id": [7, 8]}).eos_token_ids == (7, 8)
    assert ModelSpec.from_hf(dict(cfg, eos_token_id=None)).eos_token_ids == ()


def test_from_dir_names_a_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelSpec.from_dir(tmp_path)


def test_both_rope_layouts_read_the_same():
    base = dict(BASE, model_type="qwen2")
    old = ModelSpec.from_hf({**base, "rope_theta": 12345.0})
    new = ModelSpec.from_hf(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}}
    )
    assert old.rope == new.rope and old.rope.theta == 12345.0
    scaled_old = ModelSpec.from_hf(
        {
            **base,
            "rope_theta": 5e5,
            "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"},
        }
    )
    assert scaled_old.rope.rope_type == "llama3" and scaled_old.rope.theta == 5e5
    assert old.qkv_bias and not old.qk_norm and old.head_dim == 16


@pytest.mark.parametrize("rope", ["default", "linear", "llama3"])
def test_inv_freq_matches_rope_init_functions(rope):
    """Against transformers' RoPE functions directly (`ROPE_INIT_FUNCTIONS`, the default's own
    function), not only through a model."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope, "rope_theta": 50000.0}
    if rope == "linear":
        params["factor"] = 4.0
    if rope == "llama3":
        params.update({k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")})
    cfg = dict(BASE, max_position_embeddings=512, rope_parameters=params)
    hf = transformers.LlamaConfig(**cfg)
    spec = ModelSpec.from_hf({"model_type": "llama", **cfg})
    if rope == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref, scaling = ROPE_INIT_FUNCTIONS[rope](hf, "cpu")
    torch.testing.assert_close(spec.rope.inv_freq(spec.head_dim), ref.float(), atol=0, rtol=1e-6)
    assert spec.rope.attention_scaling == scaling
