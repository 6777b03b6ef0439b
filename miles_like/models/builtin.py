"""Built-in tiny model configs (`model.builtin` in a recipe): Qwen2-architecture decoders sized
to learn the synthetic tasks on a CPU, and a Qwen3-MoE mixture of experts of the same scale,
paired with the character-level Hugging Face tokenizer of `tokenizer.py`.

A built-in is a Hugging Face `config.json` dict without the tokenizer-side entries; `hf_config`
fills those from the tokenizer, so the model's vocabulary is exactly the tokenizer's.
"""

from __future__ import annotations

from typing import Any

from miles_like.models.tokenizer import HFTokenizer

_QWEN2_BASE: dict[str, Any] = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    torch_dtype="float32",
    max_position_embeddings=512,
)

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(
        _QWEN2_BASE,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small-qwen2": dict(
        _QWEN2_BASE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


# Qwen3-MoE: every layer sparse, 8 experts of width 64, each token routed to 2 (renormalised).
_TINY_QWEN3_MOE: dict[str, Any] = dict(
    _QWEN2_BASE,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=64,
    intermediate_size=176,  # a dense layer's width (none here: decoder_sparse_step=1)
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
BUILTIN_MODELS["tiny-qwen3-moe"] = _TINY_QWEN3_MOE


def hf_config(name: str, tokenizer: HFTokenizer) -> dict[str, Any]:
    """The full `config.json` dict of built-in `name` for `tokenizer`."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"model.builtin={name!r}: use one of {', '.join(BUILTIN_MODELS)}")
    return {**BUILTIN_MODELS[name], **tokenizer.hf_config_fields()}
