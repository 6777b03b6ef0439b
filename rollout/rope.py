"""Rotary position embedding, in the Hugging Face "rotate half" layout.

cos/sin are precomputed for every position up to `max_positions` in float32 (as HF does; in
float64 for a float64 model) and gathered by position id, so a token's rotation depends only on
its position, never on how the batch is packed.
"""

from __future__ import annotations

import math

import torch

from rollout.model_config import RopeConfig


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    # On the CPU whatever the default device (the caller moves the tables): under the meta
    # device (`CausalLM.build`) these ops are Python decompositions that import dynamo.
    positions = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (rope.theta ** (positions.to(dtype) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between is interpolated smoothly between the two.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim, dtype)
        freqs = torch.outer(torch.arange(max_positions, dtype=dtype, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Buffers are not parameters: they never appear among the HF-named weights.
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], positions: [T] -> rotated q, k (same dtype)."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (q and k heads side by side) -> rotated, each element as `forward`
        computes it."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
