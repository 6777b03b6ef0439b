"""Rotary position embedding parameters as Hugging Face transformers reads them, and their
inverse frequencies.

transformers 5 keeps every RoPE parameter in `rope_parameters` (`rope_type`, `rope_theta`,
scaling factors); transformers 4 checkpoints have a top-level `rope_theta` and an optional
`rope_scaling` dict (`type` or `rope_type`). Both layouts are read the way transformers 5 reads
them (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`): a non-empty `rope_scaling`
replaces `rope_parameters` whole, a `rope_theta` inside the dict wins over the top-level one,
llama3's `original_max_position_embeddings` defaults to `max_position_embeddings`, and a
missing required factor is an error, never a guessed value.

The kinds accepted are those whose rotation is a fixed function of the position with no
attention scaling: default, linear and llama3. yarn and longrope scale the attention and dynamic
depends on the sequence length; none of the engine, the megatron trainer or their kernels
implement that, so they are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from model_spec.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_THETA = 10000.0
# the keys each kind must have (transformers raises KeyError without them)
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float = DEFAULT_THETA
    rope_type: str = "default"
    factor: float = 1.0  # linear and llama3: how far the context was stretched
    # llama3 only: the band of wavelengths interpolated between scaled and unscaled
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        self.check_integrity()

    def check_integrity(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"RopeSpec.rope_type={self.rope_type!r}: use {SUPPORTED_ROPE_TYPES}")
        llama3 = (
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        )
        if self.rope_type == "llama3" and None in llama3:
            raise ValueError("RopeSpec: llama3 needs low/high_freq_factor and the original length")

    @property
    def attention_scaling(self) -> float:
        """The factor on cos / sin (transformers' second return value): 1 for every kind here."""
        return 1.0

    def inv_freq(self, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse frequencies, computed the way transformers does for this kind: in float32,
        or in float64 for a float64 model (whose rotary angles are then exact to float64, too).
        On the CPU whatever the default device (the caller moves them): under the meta device
        these ops are Python decompositions that import dynamo."""
        positions = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
        inv = 1.0 / (self.theta ** (positions.to(dtype) / head_dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3_scale(inv)
        return inv

    def _llama3_scale(self, inv: torch.Tensor) -> torch.Tensor:
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
        # between is interpolated smoothly between the two.
        old_len = self.original_max_position_embeddings
        low, high = self.low_freq_factor, self.high_freq_factor
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


def rope_from_hf(cfg: dict[str, Any], max_position_embeddings: int) -> RopeSpec:
    """The RoPE of a config.json dict, read as transformers 5 reads it (module docstring)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            f"config.json {key}: expected one flat dict of RoPE parameters (per-layer-type RoPE "
            "is not supported)"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json {key} rope type {rope_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a checkpoint with one of those"
        )
    missing = [k for k in _REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise UnsupportedModelError(
            f"config.json {key} for rope type {rope_type!r} lacks {', '.join(missing)}; add "
            "them (transformers refuses this config too)"
        )
    theta = float(params.get("rope_theta", cfg.get("rope_theta", DEFAULT_THETA)))
    if rope_type == "default":
        return RopeSpec(theta)
    if rope_type == "linear":
        return RopeSpec(theta, "linear", float(params["factor"]))
    return RopeSpec(
        theta,
        "llama3",
        float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_position_embeddings
        ),
    )
