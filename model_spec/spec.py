"""`ModelSpec`: the architecture a Hugging Face `config.json` describes, as transformers builds it.

Families: Llama, Qwen2, Qwen3 (RMSNorm, RoPE, GQA, SwiGLU), and the mixtures of experts
Qwen2-MoE and Qwen3-MoE (the attention of Qwen2 / Qwen3; sparse layers in `moe`, see
`model_spec.moe`). They differ in which projections carry a bias (Qwen2 and Qwen2-MoE: q/k/v by
default, o never; Llama, Qwen3 and Qwen3-MoE: all four with `attention_bias`; an MLP bias only
in Llama, with `mlp_bias`), in Qwen3's per-head q/k RMSNorm, and in the defaults transformers
fills in for keys a config.json leaves out (`_FAMILY_DEFAULTS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_spec.errors import UnsupportedModelError
from model_spec.moe import MOE_MODEL_TYPES, MoESpec, moe_from_hf
from model_spec.rope import RopeSpec, rope_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# transformers' `<Family>Config` defaults for keys that matter when absent from config.json
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16, "head_dim": None},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "head_dim": None},
}
# Qwen2 / Qwen3: sliding-window attention on layers >= max_window_layers when switched on
_SLIDING_WINDOW_DEFAULTS = {"sliding_window": 4096, "max_window_layers": 28}


@dataclass(frozen=True)
class ModelSpec:
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
    rope: RopeSpec
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    moe: MoESpec | None = None  # the sparse layers of a mixture of experts; None: dense

    def __post_init__(self):
        self.check_integrity()

    def check_integrity(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelSpec:
        """Read a config.json dict (and generation_config.json's, for the EOS ids); raise
        UnsupportedModelError naming the config.json key of anything we cannot run exactly."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"config.json hidden_act {act!r}: only 'silu' (SwiGLU) is supported"
            )
        defaults = _FAMILY_DEFAULTS[model_type]
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        if model_type in MOE_MODEL_TYPES:
            _refuse_any_sliding_window(hf)
        elif model_type != "llama":
            _refuse_sliding_window(hf, num_layers)
        max_positions = int(
            _get(hf, "max_position_embeddings", defaults["max_position_embeddings"])
        )
        attention_bias = bool(hf.get("attention_bias") or False)
        qwen2_like = model_type in ("qwen2", "qwen2_moe")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(
                _get(hf, "num_key_value_heads", defaults["num_key_value_heads"]) or heads
            ),
            head_dim=int(_get(hf, "head_dim", defaults["head_dim"]) or hidden // heads),
            rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            rope=rope_from_hf(hf, max_positions),
            # Qwen2: q/k/v always biased (Qwen2-MoE: unless qkv_bias=false), o_proj never;
            # Llama / Qwen3 / Qwen3-MoE: one flag for all four
            qkv_bias=(bool(_get(hf, "qkv_bias", True)) if model_type == "qwen2_moe" else True)
            if qwen2_like
            else attention_bias,
            o_bias=not qwen2_like and attention_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias") or False),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(hf, generation_config),
            moe=moe_from_hf(hf, num_layers) if model_type in MOE_MODEL_TYPES else None,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        """The spec of a local Hugging Face model directory (config.json, and
        generation_config.json when present)."""
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


def _get(hf: dict[str, Any], key: str, default: Any) -> Any:
    """`hf[key]`, or transformers' default where the key is absent or null."""
    value = hf.get(key)
    return default if value is None else value


def _refuse_sliding_window(hf: dict[str, Any], num_layers: int) -> None:
    """Qwen2 / Qwen3 as transformers builds them: layer i attends within `sliding_window` when
    `use_sliding_window` is on and `layer_types[i]` is "sliding_attention" (by default the layers
    from `max_window_layers` on). Neither side implements a window, so such a layer is refused."""
    if not hf.get("use_sliding_window"):
        return
    window = hf.get("sliding_window", _SLIDING_WINDOW_DEFAULTS["sliding_window"])
    if window is None:
        return
    first_full = int(_get(hf, "max_window_layers", _SLIDING_WINDOW_DEFAULTS["max_window_layers"]))
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first_full else "full_attention" for i in range(num_layers)
    ]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise UnsupportedModelError(
            f"config.json use_sliding_window=true puts layers {sliding} in sliding-window "
            "attention, which is not supported; set it to false (full attention)"
        )


def _refuse_any_sliding_window(hf: dict[str, Any]) -> None:
    """Qwen2-MoE / Qwen3-MoE with `use_sliding_window` attend within a window (on every layer, or
    on the `layer_types` ones); neither side implements a window."""
    if hf.get("use_sliding_window") and hf.get("sliding_window", 4096) is not None:
        raise UnsupportedModelError(
            f"config.json use_sliding_window=true ({hf['model_type']}) puts layers in "
            "sliding-window attention, which is not supported; set it to false (full attention)"
        )


def _eos_ids(hf: dict[str, Any], generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id where it has one, else config.json's."""
    eos = hf.get("eos_token_id")
    if generation_config and generation_config.get("eos_token_id") is not None:
        eos = generation_config["eos_token_id"]
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
