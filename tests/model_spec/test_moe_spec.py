"""The mixture-of-experts fields of config.json (`model_spec.moe`) against Hugging Face
transformers: each config is written to a directory, read back with `AutoConfig.from_pretrained`
and built into an HF model, whose layers say which are sparse, how many experts of which width
they hold, how many each token goes to, whether the top-k is renormalised, and whether a shared
expert is there. Both spellings of the expert count are read: `num_experts` (Qwen's checkpoints)
and `num_local_experts` (what transformers 5 writes)."""

from __future__ import annotations

import json

import pytest

from model_spec import ModelSpec, UnsupportedModelError

from tiny_hf import MOE_FAMILIES

VARIANTS = {
    "as-is": {},
    "every-other-layer": {"decoder_sparse_step": 2, "mlp_only_layers": []},
    "dense-listed": {"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]},
    "defaults": None,  # the MoE keys left out: transformers' defaults
}
MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
)


def _hf_model(cfg: dict, tmp_path):
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    return config, transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_fields_read_as_transformers_builds_them(family, variant, tmp_path):
    cfg = dict(MOE_FAMILIES[family], num_hidden_layers=4)
    if VARIANTS[variant] is None:
        cfg = {k: v for k, v in cfg.items() if k not in MOE_KEYS}
        cfg.update(hidden_size=32, intermediate_size=32)  # the default 128 experts stay small
    else:
        cfg.update(VARIANTS[variant])
    config, model = _hf_model(cfg, tmp_path)
    spec = ModelSpec.from_hf(cfg)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert spec.moe is not None and list(spec.moe.sparse_layers) == sparse
    block = model.model.layers[sparse[0]].mlp
    assert spec.moe.num_experts == block.experts.num_experts == config.num_experts
    assert spec.moe.expert_intermediate_size == block.experts.intermediate_dim
    assert spec.moe.top_k == block.gate.top_k
    assert spec.moe.norm_topk_prob == block.gate.norm_topk_prob
    shared = getattr(block, "shared_expert", None)
    width = shared.intermediate_size if shared is not None else 0
    assert spec.moe.shared_expert_intermediate_size == width
    attn = model.model.layers[0].self_attn
    assert spec.qkv_bias == (attn.q_proj.bias is not None)
    assert spec.o_bias == (attn.o_proj.bias is not None)
    assert spec.qk_norm == hasattr(attn, "q_norm")
    assert spec.head_dim == attn.head_dim and spec.num_kv_heads == config.num_key_value_heads

    # what save_pretrained writes (Qwen3-MoE: num_local_experts) reads the same
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    expert_key = "num_local_experts" if family == "qwen3_moe" else "num_experts"
    assert expert_key in saved
    assert ModelSpec.from_hf(saved).moe == spec.moe


def test_qwen2_moe_without_qkv_bias(tmp_path):
    cfg = dict(MOE_FAMILIES["qwen2_moe"], qkv_bias=False)
    _, model = _hf_model(cfg, tmp_path)
    assert model.model.layers[0].self_attn.q_proj.bias is None
    assert ModelSpec.from_hf(cfg).qkv_bias is False


def test_dense_configs_have_no_moe():
    assert ModelSpec.from_hf(dict(MOE_FAMILIES["qwen3_moe"], num_experts=0)).moe is None
    assert ModelSpec.from_hf(dict(MOE_FAMILIES["qwen3_moe"], mlp_only_layers=[0, 1, 2])).moe is None


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ],
)
def test_moe_refusals_are_one_line_naming_the_key(extra, needle):
    with pytest.raises(UnsupportedModelError, match=needle) as error:
        ModelSpec.from_hf(dict(MOE_FAMILIES["qwen3_moe"], **extra))
    assert "\n" not in str(error.value)
