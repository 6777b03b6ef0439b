"""The model description we accept: a Hugging Face `config.json` dict, read once into `HFArch`.

Supported families are the Llama / Qwen2 / Qwen3 decoder: RMSNorm, RoPE, GQA, SwiGLU, optional
QKV bias, optional per-head q/k RMSNorm (Qwen3), tied or untied embeddings. Both the
transformers-5 layout (`rope_parameters = {rope_type, rope_theta, ...}`) and the older one
(top-level `rope_theta`, `rope_scaling`) are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# RoPE variants whose inverse frequencies we can compute exactly and hand to megatron. Others
# (yarn, longrope, dynamic) also change attention scaling or depend on sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """A config.json this trainer cannot represent; the message names the field."""


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    # Only for scaled variants: the HF parameter dict minus type/theta, as sorted pairs.
    scaling: tuple[tuple[str, float], ...] = ()

    def inv_freq(self, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse frequencies, computed the way HF transformers does for this type: in fp32,
        or in fp64 for a float64 model (whose rotary angles are then exact to fp64, too)."""
        inv = 1.0 / (
            self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim)
        )
        params = dict(self.scaling)
        if self.rope_type == "linear":
            return inv / params["factor"]
        if self.rope_type == "llama3":
            factor = params["factor"]
            low, high = params["low_freq_factor"], params["high_freq_factor"]
            old_len = params["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class HFArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int


def _rope_from_config(cfg: dict) -> RopeSpec:
    params = cfg.get("rope_parameters")
    if params is None:  # transformers 4 layout
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_type", params.pop("type", "default"))
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json rope type {rope_type!r} is not supported by the megatron trainer "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint with one of those "
            "or the deepspeed backend (trainer.backend: deepspeed)"
        )
    if rope_type == "default":
        return RopeSpec("default", theta)
    needed = {
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }[rope_type]
    missing = [k for k in needed if k not in params]
    if missing:
        raise UnsupportedModelError(f"config.json rope parameters for {rope_type!r} lack {missing}")
    return RopeSpec(rope_type, theta, tuple(sorted((k, float(params[k])) for k in needed)))


def arch_from_hf_config(cfg: dict) -> HFArch:
    """Read a HF config.json dict; raise UnsupportedModelError naming the offending field."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"config.json model_type {model_type!r} is not supported by the megatron trainer "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(
            f"config.json hidden_act {act!r}: only 'silu' (SwiGLU) is supported"
        )
    if cfg.get("mlp_bias", False):
        raise UnsupportedModelError("config.json mlp_bias=true is not supported")
    if cfg.get("use_sliding_window", False):
        raise UnsupportedModelError(
            "config.json use_sliding_window=true is not supported; set it to false (full attention)"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    # Qwen2 always has QKV bias; Llama / Qwen3 have it when attention_bias is set.
    qkv_bias = True if model_type == "qwen2" else bool(cfg.get("attention_bias", False))
    if model_type == "qwen3" and cfg.get("attention_bias", False):
        raise UnsupportedModelError(
            "config.json attention_bias=true with qwen3 also biases o_proj, which is not supported"
        )
    if model_type == "llama" and cfg.get("attention_bias", False):
        raise UnsupportedModelError(
            "config.json attention_bias=true with llama also biases o_proj, which is not supported"
        )
    return HFArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_config(cfg),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )
