"""Rotary position embedding, in the Hugging Face "rotate half" layout, for the engine.

The inverse frequencies are the shared parser's (`model_spec.RopeSpec.inv_freq`, the trainer
uses the same function).

cos/sin are precomputed for every position up to `max_positions` in float32 (as HF does; in
float64 for a float64 model) and gathered by position id, so a token's rotation depends only on
its position, never on how the batch is packed.
"""

from __future__ import annotations

import torch

from model_spec import RopeSpec


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        rope: RopeSpec,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        inv_freq = rope.inv_freq(head_dim, dtype)
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
