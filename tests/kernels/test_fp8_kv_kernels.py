"""The Triton kernels over an FP8 KV pool (interpreted on CPU, see conftest.py).

* the KV-store kernel stores the same bytes as the reference `KVPool.store` (torch's e4m3 cast
  of saturate(x / scale)), outliers saturating alike;
* the decode kernel over an FP8 cache equals the same kernel over a float cache holding the
  dequantized values, bitwise, and the torch reference over the FP8 cache to float32 rounding;
* `TritonAttention` over an FP8 pool leaves the same pool as `TorchAttention` and the same
  outputs; an FP8 engine generates the same tokens with either backend.
"""

import pytest
import torch

from rollout.attention import AttentionMetadata, PrefillSegment, TorchAttention
from rollout.kernels import (
    TritonAttention,
    decode_attention,
    triton_cascade_decode_attention,
    triton_store_kv,
)
from rollout.kv_pool import KVPool
from rollout.kv_quant import dequantize, head_scale, quantize, scales_from_amax

from kernel_cases import cascade_metadata, random_pool

assert decode_attention.INTERPRETED, (
    "kernel tests need TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)"
)


def fp8_pool(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, g):
    pool = KVPool(
        num_layers=2,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        storage_dtype=torch.float8_e4m3fn,
        device=torch.device("cpu"),
    )
    amax = torch.rand(2, num_kv_heads, generator=g) * 4 + 0.5
    pool.set_scales(scales_from_amax(amax), scales_from_amax(amax.flip(-1)))
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_store_quantizes_as_the_pool_does(dtype):
    g = torch.Generator().manual_seed(0)
    pools = [fp8_pool(10, 4, 3, 20, dtype, g) for _ in range(2)]
    for pool in pools[1:]:
        pool.set_scales(pools[0].k_scale, pools[0].v_scale)
    k = (torch.randn(7, 3, 20, generator=g) * 2).to(dtype)
    v = (torch.randn(7, 3, 20, generator=g) * 2).to(dtype)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 1e-9])  # saturating and underflowing
    slots = torch.randperm(40, generator=g)[:7]
    pools[0].store(1, slots, k, v)
    triton_store_kv(
        k, v, pools[1].k[1], pools[1].v[1], slots, pools[1].k_scale[1], pools[1].v_scale[1]
    )
    for want, got in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert pools[0].k.float().abs().max() == 448.0  # the outlier saturated


def test_kv_store_needs_scales_for_an_fp8_pool():
    k = torch.zeros(2, 1, 16)
    cache = torch.zeros(1, 8, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn with scales"):
        triton_store_kv(k, k, cache, cache.clone(), torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_over_fp8_equals_decode_over_the_dequantized_cache(dtype):
    g = torch.Generator().manual_seed(3)
    page_size = 4
    k_cache, v_cache = random_pool(2, 96, page_size, 32, torch.float32, g)
    scales = tuple(scales_from_amax(c.abs().amax(dim=(1, 2))) for c in (k_cache, v_cache))
    k8, v8 = (quantize(c, head_scale(s, 0, 3)) for c, s in zip((k_cache, v_cache), scales))
    k_deq, v_deq = (dequantize(c, head_scale(s, 0, 3), dtype) for c, s in zip((k8, v8), scales))
    meta = cascade_metadata(
        [(3, [1, 20, 35]), (0, [44])], page_size, 96, g, num_queries=[[1, 2, 1], [3]]
    )
    q = torch.randn(meta.num_tokens, 6, 32, generator=g).to(dtype)
    got = triton_cascade_decode_attention(
        q, k8, v8, meta, page_size, chunk_tokens=32, kv_scales=scales
    )
    want = triton_cascade_decode_attention(q, k_deq, v_deq, meta, page_size, chunk_tokens=32)
    assert torch.equal(got, want)
    if dtype == torch.float32:  # and the torch reference over the FP8 cache
        reference = decode_attention_reference(q, k8, v8, meta, page_size, scales)
        assert (got - reference).abs().max() <= 1e-5
        plain = triton_cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
        assert (got - plain).abs().max() > 1e-3  # the cache really was quantized


def decode_attention_reference(q, k8, v8, meta, page_size, scales):
    from rollout.attention import cascade_decode_attention

    return cascade_decode_attention(q, k8, v8, meta, page_size, kv_scales=scales)


def test_triton_backend_over_an_fp8_pool_matches_the_torch_backend():
    g = torch.Generator().manual_seed(7)
    page_size, num_kv_heads, num_heads, head_dim = 4, 2, 6, 16
    decode_pages, prefill_pages = 48, 8
    pools = [
        fp8_pool(decode_pages + prefill_pages, page_size, num_kv_heads, head_dim, torch.float32, g)
    ]
    pools.append(
        fp8_pool(decode_pages + prefill_pages, page_size, num_kv_heads, head_dim, torch.float32, g)
    )
    pools[1].set_scales(pools[0].k_scale, pools[0].v_scale)
    init_k = torch.randn(pools[0].k.shape, generator=g).to(torch.float8_e4m3fn)
    init_v = torch.randn(pools[0].v.shape, generator=g).to(torch.float8_e4m3fn)
    for pool in pools:
        pool.k.copy_(init_k)
        pool.v.copy_(init_v)
    meta_decode = cascade_metadata(
        [(2, [3, 11]), (0, [6])], page_size, decode_pages, g, num_queries=[[1, 3], [1]]
    )
    context = torch.arange(decode_pages * page_size, decode_pages * page_size + 11)
    segment = PrefillSegment(meta_decode.num_tokens, 5, context, prefix_len=6)
    num_queries = meta_decode.suffix_bias.shape[1]
    seq = meta_decode.token_cell // num_queries
    visible = meta_decode.suffix_bias[seq, meta_decode.token_cell % num_queries] != float("-inf")
    position = (visible * torch.arange(1, visible.shape[1] + 1)).amax(-1) - 1
    decode_slots = meta_decode.suffix_pages[seq, position // page_size] * page_size
    out_slots = torch.cat([decode_slots + position % page_size, context[6:]])
    meta = AttentionMetadata(out_slots, meta_decode, (segment,))
    num_tokens = out_slots.shape[0]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    want = TorchAttention(pools[0]).forward(1, q, k, v, meta)
    got = TritonAttention(pools[1], chunk_tokens=16).forward(1, q, k, v, meta)
    for a, b in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (got - want).abs().max().item() <= 1e-5
    # a decode-only step: the Triton backend counts the stored K/V without dequantizing them
    decode_only = AttentionMetadata(out_slots[: meta_decode.num_tokens], meta_decode, ())
    rows = slice(0, meta_decode.num_tokens)
    want = TorchAttention(pools[0]).forward(0, q[rows], 600 * k[rows], v[rows], decode_only)
    got = TritonAttention(pools[1], chunk_tokens=16).forward(
        0, q[rows], 600 * k[rows], v[rows], decode_only
    )
    assert (got - want).abs().max().item() <= 1e-5
    assert int(pools[0].stored) == int(pools[1].stored) > 0
    assert int(pools[0].clipped) == int(pools[1].clipped) > 0  # 600 x k saturates some


def test_fp8_engine_generates_the_same_with_the_triton_backend(tmp_path):
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint

    config = {
        **TINY_QWEN2,
        "hidden_size": 96,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    }
    directory = write_random_checkpoint(tmp_path / "ckpt", config, std=0.15)
    prompts = [[5, 17, 3, 44, 9, 60, 2, 31, 8, 12], [7, 70, 1, 22, 5, 90, 13]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=11, ignore_eos=True)
    results = []
    for backend in ("torch", "triton"):
        engine = Engine(
            EngineConfig(
                model_path=str(directory),
                kv_cache_dtype="fp8_e4m3",
                kv_cache_tokens=256,
                page_size=4,
            )
        )
        if backend == "triton":  # no config switch selects it on CPU: the runner's seam
            engine.runner.attention = TritonAttention(engine.pool, chunk_tokens=16)
        results.append(engine.generate(prompts, params))
    for want_prompt, got_prompt in zip(*results):
        for w, got in zip(want_prompt, got_prompt):
            assert list(got.token_ids) == list(w.token_ids)
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0
            )
