"""The model description we accept: a Hugging Face `config.json` of the Llama / Qwen2 / Qwen3
family.

`ModelConfig.from_hf` normalises the differences between families and between transformers 4
(`rope_theta`, `rope_scaling`) and transformers 5 (`rope_parameters`) into one frozen record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type={model_type!r}: supported are {SUPPORTED_MODEL_TYPES}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        attention_bias = bool(hf.get("attention_bias", False))
        if model_type == "qwen2":  # Qwen2 always has q/k/v bias and never an o_proj bias
            qkv_bias, o_bias = True, False
        else:  # llama, qwen3: one flag for all four projections
            qkv_bias = o_bias = attention_bias
        eos = hf.get("eos_token_id")
        if generation_config and generation_config.get("eos_token_id") is not None:
            eos = generation_config["eos_token_id"]
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(hf),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"model_path={str(model_dir)!r}: no config.json there; point it at a "
                "local Hugging Face model directory"
            )
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_hf(json.loads(config_path.read_text()), gen)


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5: everything in `rope_parameters`;
    # transformers 4: `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json rope type {rope_type!r}: supported are {SUPPORTED_ROPE_TYPES}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
