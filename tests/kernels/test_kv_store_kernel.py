"""The KV-store kernel against the reference `index_copy_` into one layer of the pool
(interpreted on CPU, see conftest.py)."""

import pytest
import torch

from rollout.kernels import decode_attention, triton_store_kv

assert decode_attention.INTERPRETED, (
    "kernel tests need TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 32), (2, 20)])
def test_kv_store_matches_index_copy(dtype, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(0)
    num_layers, num_slots, num_tokens = 2, 40, 7
    pool_k = torch.randn(num_layers, num_kv_heads, num_slots, head_dim, generator=g).to(dtype)
    pool_v = torch.randn(num_layers, num_kv_heads, num_slots, head_dim, generator=g).to(dtype)
    # k and v as the model produces them: views into a fused [T, 3 * Hkv * D] projection, so
    # rows are strided (not contiguous) but head_dim is.
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(dtype)
    k = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]

    want_k, want_v = pool_k.clone(), pool_v.clone()
    want_k[1].index_copy_(1, slots, k.transpose(0, 1))
    want_v[1].index_copy_(1, slots, v.transpose(0, 1))
    triton_store_kv(k, v, pool_k[1], pool_v[1], slots)
    # A copy: bit-exact, and layer 0 and the other slots are untouched.
    assert torch.equal(pool_k, want_k)
    assert torch.equal(pool_v, want_v)


def test_kv_store_rejects_dtype_mismatch():
    k = torch.zeros(2, 1, 16)
    cache = torch.zeros(1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pool dtype"):
        triton_store_kv(k, k, cache, cache.clone(), torch.tensor([0, 1]))
