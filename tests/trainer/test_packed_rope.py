"""Packed-sequence RoPE (`trainer.packed_rope`) is bitwise megatron-core's own `thd` rotary
embedding, values and gradients, and the attention layers use it."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from trainer import packed_rope


class _NoCP:
    @staticmethod
    def size():
        return 1

    @staticmethod
    def rank():
        return 0


def _config():
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_rope_is_bitwise_megatrons(dtype):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 17, 8, 8, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t, heads, d = int(cu[-1]), 4, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=dtype) / d))
    angles = torch.outer(torch.arange(32, dtype=dtype), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, d]
    x = torch.randn(t, heads, d, generator=g, dtype=dtype, requires_grad=True)
    upstream = torch.randn(t, heads, d, generator=g, dtype=dtype)
    cfg = _config()
    want = rope_utils.apply_rotary_pos_emb(x, freqs, cfg, cu_seqlens=cu, cp_group=_NoCP())
    got = packed_rope.apply_rotary_pos_emb(x, freqs, cfg, cu_seqlens=cu, cp_group=_NoCP())
    again = packed_rope.apply_rotary_pos_emb(x, freqs, cfg, cu_seqlens=cu, cp_group=_NoCP())
    assert torch.equal(got, want) and torch.equal(again, want)  # cached cos / sin reused
    (grad_want,) = torch.autograd.grad(want, x, upstream)
    (grad_got,) = torch.autograd.grad(got, x, upstream)
    assert torch.equal(grad_got, grad_want)
    # and it is a rotation: position 0 of every sequence is unchanged
    assert torch.equal(got[cu[:-1].long()], x[cu[:-1].long()])


def test_attention_layers_call_the_packed_rope():
    from megatron.core.transformer import attention

    packed_rope.install()
    packed_rope.install()  # idempotent: the original is kept, not our own function
    assert attention.apply_rotary_pos_emb is packed_rope.apply_rotary_pos_emb
    assert packed_rope._original is rope_utils.apply_rotary_pos_emb
