"""The C prefill-attention kernel (`rollout.native.prefill_attention`) against SDPA in float64 on
the same values: its vector build (AMX tiles for bfloat16 where the CPU has them), the same
without AMX (the AVX-512 path, on such a CPU) and its portable build, float32 and bfloat16
inputs, GQA ratios 1 / 4 / 8, head sizes with and without a vector path, ragged chunk lengths
(not multiples of the query or key blocks), chunks after a cached prefix, q read in place from
a fused projection's output; and the engine's `prefill_attention` on it against its float64
torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_builds import builds

from rollout import native
from rollout.attention import AttentionMetadata, PrefillSegment, TorchAttention
from rollout.kv_pool import KVPool

pytestmark = pytest.mark.skipif(
    native.prefill() is None, reason="no C compiler: prefill attention uses SDPA"
)

BUILDS = builds(native.prefill)
if BUILDS["native"].prefill_attention_has_amx():
    BUILDS["no_amx"] = native.prefill.build(native.NO_AMX_FLAGS)


def _on_amx(lib, dtype, head_dim) -> bool:
    """Whether `lib` runs these inputs on AMX tiles (rounding the probabilities to bfloat16)."""
    return (
        dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 128
        and bool(lib.prefill_attention_has_amx())
    )


def _reference(q, k, v):
    """q [count, n, H, D], k / v [count, Hkv, C, D] -> SDPA in float64, query i seeing keys
    <= C - n + i, as [count, n, H, D]."""
    n, context = q.shape[1], k.shape[2]
    positions = torch.arange(context)
    mask = positions.unsqueeze(0) <= positions[context - n :].unsqueeze(-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


def _reference_rounded_probabilities(q, k, v):
    """The AMX path's function in float64: softmax probabilities rounded to bfloat16 before
    P V (as torch's bfloat16 SDPA rounds them), and sum_t p_t |v_t| (each output's error
    scale); both [count, n, H, D]."""
    n, context, group = q.shape[1], k.shape[2], q.shape[2] // k.shape[1]
    positions = torch.arange(context)
    mask = positions.unsqueeze(0) <= positions[context - n :].unsqueeze(-1)
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = q.transpose(1, 2).double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = p.to(torch.bfloat16).double() @ v
    return out.transpose(1, 2), (p @ v.abs()).transpose(1, 2)


def _check_amx(got, q, k, v):
    """The AMX path against `_reference_rounded_probabilities`. With u = 2^-8 (bfloat16's unit
    roundoff: 8 significant bits, rounded to nearest), its weights are the bfloat16 roundings
    of e^(s - m) (m the running maximum), each within a factor (1 +- u), over their own sum
    (also within (1 +- u) of the exact one), so each weight is within 2u / (1 - u) of p_t; the
    reference's bfloat16(p_t) is within u of p_t: |got - want| <= 3u / (1 - u) *
    sum_t p_t |v_t|, plus the output's rounding to bfloat16 (u relative) and float32 sums
    (1e-5)."""
    want, scale = _reference_rounded_probabilities(q, k, v)
    err = (got.double() - want).abs()
    u = 2.0**-8
    assert (err <= want.abs() * u + scale * 3 * u / (1 - u) + 1e-5).all(), err.max().item()


def _check(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=3e-6, rtol=3e-6)
    else:  # float32 arithmetic, the output rounded once to bfloat16
        err = (got.double() - want).abs()
        assert (err <= want.abs() * 2.0**-8 + 1e-5).all(), err.max().item()


def test_the_builds_differ_in_their_vector_path():
    """Guards the tests below: the portable build really runs the plain loops."""
    flags = open("/proc/cpuinfo").read()
    assert BUILDS["native"].prefill_attention_has_avx512() == int("avx512f" in flags)
    if "amx_bf16" not in flags:
        assert BUILDS["native"].prefill_attention_has_amx() == 0
    if "no_amx" in BUILDS:  # this CPU has AMX: the no_amx build runs the AVX-512 path on it
        assert BUILDS["no_amx"].prefill_attention_has_amx() == 0
        assert BUILDS["no_amx"].prefill_attention_has_avx512() == 1
    if "portable" in BUILDS:
        assert BUILDS["portable"].prefill_attention_has_avx512() == 0
        assert BUILDS["portable"].prefill_attention_has_amx() == 0


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [20, 32, 48, 64, 96, 128])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("n, context", [(1, 1), (37, 37), (150, 150), (5, 69), (70, 200)])
def test_kernel_matches_sdpa_in_float64(build, dtype, head_dim, heads, n, context):
    """Chunks of n queries over n keys (fresh prompts) or over a cached prefix of
    context - n keys too, lengths off the block sizes, GQA ratio 1, 4 and 8."""
    g = torch.Generator().manual_seed(n * 1000 + head_dim)
    (num_heads, num_kv), count = heads, 3 if n == context else 1
    q = torch.randn(count, n, num_heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(count, num_kv, context, head_dim, generator=g).to(dtype) for _ in "kv")
    out = torch.full_like(q, float("nan"))
    native.prefill_attention(BUILDS[build], q, k, v, out)
    if _on_amx(BUILDS[build], dtype, head_dim):
        _check_amx(out, q, k, v)
    else:
        _check(out, _reference(q, k, v), dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projection_rows_are_read_in_place_with_any_thread_count(threads, dtype):
    """q, k, v as the views of one fused q/k/v output [T, H + 2 Hkv, D] (what the engine passes)
    give bitwise the result of contiguous copies, for any number of threads."""
    g = torch.Generator().manual_seed(3)
    count, n, num_heads, num_kv, head_dim = 4, 45, 8, 2, 32
    fused = torch.randn(count * n, num_heads + 2 * num_kv, head_dim, generator=g).to(dtype)
    q, k, v = fused.split([num_heads, num_kv, num_kv], dim=1)
    q, k, v = (x.unflatten(0, (count, n)) for x in (q, k, v))
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [count, Hkv, n, D] strided views
    assert not q.is_contiguous() and not k.is_contiguous()
    lib, before = native.prefill(), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        in_place = torch.empty_like(q.contiguous())
        native.prefill_attention(lib, q, k, v, in_place)
    finally:
        torch.set_num_threads(before)
    copied = torch.empty_like(in_place)
    native.prefill_attention(lib, q.contiguous(), k.contiguous(), v.contiguous(), copied)
    assert torch.equal(in_place, copied)
    if _on_amx(lib, dtype, head_dim):
        _check_amx(in_place, q, k, v)
    else:
        _check(in_place, _reference(q, k, v), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_prefill_on_the_kernel_matches_its_float64_torch_path(dtype):
    """`TorchAttention.forward` over fresh chunks of two lengths and a chunk after a cached
    prefix: the kernel's result (float32 / bfloat16) against the float64 pool's SDPA path on the
    same values."""
    g = torch.Generator().manual_seed(11)
    num_heads, num_kv, head_dim, page_size, slots = 8, 2, 32, 4, 256
    lengths = [(0, 30), (0, 30), (0, 30), (0, 17), (40, 9)]  # (cached prefix, new tokens)
    num_tokens = sum(n for _, n in lengths)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv, head_dim, generator=g).to(dtype) for _ in "kv")
    cached = [torch.randn(num_kv, 40, head_dim, generator=g).to(dtype) for _ in "kv"]
    outs = {}
    for pool_dtype in (dtype, torch.float64):
        pool = KVPool(
            num_layers=1, num_pages=slots // page_size, page_size=page_size, num_kv_heads=num_kv,
            head_dim=head_dim, dtype=pool_dtype, device=torch.device("cpu"),
        )  # fmt: skip
        pool.k[0, :, 200:240], pool.v[0, :, 200:240] = (c.to(pool_dtype) for c in cached)
        segments, out_slots, start, free = [], [], 0, 0
        for prefix_len, n in lengths:
            new = torch.arange(free, free + n)
            context = torch.cat([torch.arange(200, 200 + prefix_len), new])
            segments.append(PrefillSegment(start, n, context, prefix_len))
            out_slots.append(new)
            start, free = start + n, free + n
        meta = AttentionMetadata(torch.cat(out_slots), None, tuple(segments))
        attention = TorchAttention(pool)
        outs[pool_dtype] = attention.forward(0, *(x.to(pool_dtype) for x in (q, k, v)), meta)
    want, got = outs[torch.float64], outs[dtype]
    assert got.dtype == dtype
    if _on_amx(native.prefill(), dtype, head_dim):
        # probabilities rounded to bfloat16 (_check_amx): each weight within 2u / (1 - u) of
        # the float64 one's (u = 2^-8), so each output within 2u / (1 - u) * sum_t p_t |v_t|
        # <= 2u / (1 - u) * max |v| of it, plus its own rounding (u relative)
        err = (got.double() - want).abs()
        v_max = max(v.abs().max().item(), *(c.abs().max().item() for c in cached))
        u = 2.0**-8
        assert (err <= want.abs() * u + 2 * u / (1 - u) * v_max).all(), err.max().item()
    else:
        _check(got, want, dtype)
