"""The engine's element-wise C kernels (`rollout/native/pointwise.c`) against their torch
references: RMSNorm (`rollout.model.RMSNorm`), rotary (`RotaryEmbedding.rotate`), SiLU * up and
the K/V row stores (`index_copy_`); the vector (AVX2) and the portable build; and the native
model pieces (`rollout.native.layers`) against the reference pieces on a real model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_builds import builds

from model_spec import RopeSpec
from rollout import native
from rollout.model import RMSNorm
from rollout.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    native.pointwise() is None, reason="no C compiler: the engine runs these steps in torch"
)

BUILDS = builds(native.pointwise)
assert "portable" not in BUILDS or BUILDS["portable"].pointwise_has_avx2() == 0


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens, hidden", [(1, 8), (5, 20), (300, 256), (3, 1000)])
def test_rms_norm_matches_the_module(build, tokens, hidden):
    """Within a few float32 ulps of the torch module (the sum of squares is added in another
    order), measured against the float64 value of the same formula. A strided input (every other
    row of a wider buffer) is read in place."""
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = _randn(hidden, seed=1)
    wide = _randn(tokens, 2 * hidden, seed=2, scale=3.0)
    x = wide[:, :hidden]
    got = native.rms_norm(BUILDS[build], x, norm.weight, norm.eps)
    ref64 = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref64 = norm.weight.double() * ref64
    with torch.no_grad():
        torch_err = (norm(x).double() - ref64).abs().max()
    ours_err = (got.double() - ref64).abs().max()
    assert ours_err <= max(4 * torch_err, 1e-6 * ref64.abs().max()), (ours_err, torch_err)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rotary_equals_the_module_bitwise(build, head_dim):
    """x1 c - x2 s, x2 c + x1 s with no fused multiply-add: exactly torch's x * cos +
    rotate_half(x) * sin, in place over the q and k heads of a fused q/k/v output."""
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, 512)
    heads, kv_heads, tokens = 6, 2, 37
    qkv = _randn(tokens, heads + 2 * kv_heads, head_dim, seed=head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(3))
    qk = qkv[:, : heads + kv_heads]
    expected = rope.rotate(qk, positions)
    v_before = qkv[:, heads + kv_heads :].clone()
    native.rotary_(BUILDS[build], qk, rope.cos, rope.sin, positions)
    assert torch.equal(qkv[:, : heads + kv_heads], expected)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # v is not touched


def test_rotary_refuses_a_position_outside_the_tables():
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), 8, 16)
    x = _randn(3, 2, 8)
    before = x.clone()
    with pytest.raises(IndexError, match="outside the tables' 16 rows"):
        native.rotary_(native.pointwise(), x, rope.cos, rope.sin, torch.tensor([0, 16, 1]))
    assert torch.equal(x, before)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("width", [1, 7, 8, 704, 1001])
def test_silu_mul_matches_torch(build, width):
    """silu(gate) * up over the two halves of one [T, 2I] projection output, within 2 float32
    ulps of the float64 value (torch's own error is about 1)."""
    gate_up = _randn(9, 2 * width, seed=width, scale=6.0)
    gate, up = gate_up.chunk(2, dim=-1)
    got = native.silu_mul(BUILDS[build], gate, up)
    ref64 = F.silu(gate.double()) * up.double()
    ulp = torch.finfo(torch.float32).eps * ref64.abs().clamp_min(1e-30)
    assert ((got.double() - ref64).abs() <= 2 * ulp + 1e-37).all()
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_silu_mul_16_and_8_wide_agree_bitwise():
    """The vector build's float32 SiLU * up runs 16 lanes at a time (AVX-512), then 8 (AVX2),
    then one: the same values in rows of 8 (the 8-wide loop only) and of 16 (the 16-wide loop
    only) give the same bits, the exp polynomial being the same lane for lane. Values span exp's
    clamps (|gate| up to ~100) and 0."""
    gate = torch.cat([_randn(64, seed=3, scale=6.0), torch.linspace(-100, 100, 63), torch.zeros(1)])
    up = _randn(128, seed=4, scale=2.0)
    lib = BUILDS["native"]
    eight = native.silu_mul(lib, gate.view(16, 8), up.view(16, 8)).flatten()
    sixteen = native.silu_mul(lib, gate.view(8, 16), up.view(8, 16)).flatten()
    assert torch.equal(eight, sixteen)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_row_scatter_equals_index_copy(build):
    """Pool-shaped [Hkv, slots, D] destination, K of a fused q/k/v output as source (token stride
    wider than its heads): bitwise what index_copy_ writes, and nothing else changes."""
    kv_heads, slots, head_dim, tokens = 2, 500, 16, 130
    qkv = _randn(tokens, 4 + 2 * kv_heads, head_dim, seed=4)
    k = qkv[:, 4 : 4 + kv_heads]
    index = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[:tokens]
    dst = _randn(kv_heads, slots, head_dim, seed=6)
    expected = dst.clone().index_copy_(1, index, k.transpose(0, 1))
    native.scatter_rows_(BUILDS[build], dst, index, k)
    assert torch.equal(dst, expected)


def test_row_scatter_refuses_an_index_out_of_range():
    dst = torch.zeros(2, 10, 4)
    with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
        native.scatter_rows_(native.pointwise(), dst, torch.tensor([3, 10]), torch.ones(2, 2, 4))
    assert not dst.any()


def test_native_pieces_match_the_reference_pieces(tmp_path):
    """A float32 engine on the native pieces against the same engine on the reference pieces
    (`DecoderLayer.attention_inputs` / `attention_outputs`, `CausalLM._logits`): the logits of a
    mixed prefill + decode batch agree to float32 rounding, and the native pieces are the ones
    the engine chose."""
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model import CausalLM, DecoderLayer, LayerPieces
    from rollout.native import layers

    from tiny_hf import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("qwen2", seed=0), tmp_path)
    engine = Engine(EngineConfig(model_path=str(tmp_path), kv_cache_tokens=2048, seed=0))
    assert engine.model.pieces.attention_inputs is layers.attention_inputs
    reference = LayerPieces(
        DecoderLayer.attention_inputs, DecoderLayer.attention_outputs, CausalLM._logits
    )
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=1)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    native_out = engine.generate(prompts, params)
    engine.model.pieces = reference
    engine.flush_prefix_cache()
    reference_out = engine.generate(prompts, params)
    for a, b in zip(native_out, reference_out):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-5, rtol=0
            )


def _within_one_bf16_ulp_mostly_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    """bfloat16 results that round float32 values computed in another order (a sum of squares):
    each within one bfloat16 ulp of the reference, and all but a few equal."""
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() >= 0.99


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens, hidden", [(1, 8), (5, 20), (300, 256), (3, 1000)])
def test_rms_norm_bf16_matches_the_module(build, tokens, hidden):
    """A bfloat16 RMSNorm: normalised in float32, rounded to bfloat16, times the bfloat16 weight
    and rounded again, as the module computes it (strided input read in place)."""
    norm = RMSNorm(hidden, 1e-6).to(torch.bfloat16)
    norm.weight.data = _randn(hidden, seed=1).bfloat16()
    x = _randn(tokens, 2 * hidden, seed=2, scale=3.0).bfloat16()[:, :hidden]
    got = native.rms_norm(BUILDS[build], x, norm.weight, norm.eps)
    with torch.no_grad():
        expected = norm(x)
    assert got.dtype == torch.bfloat16
    _within_one_bf16_ulp_mostly_equal(got, expected)


@pytest.mark.parametrize("build", sorted(BUILDS))
# 8: the scalar loop; 16: one 8-lane step; 48: a 16-lane step and an 8-lane tail
@pytest.mark.parametrize("head_dim", [8, 16, 32, 48, 64, 128])
def test_rotary_bf16_equals_the_module_bitwise(build, head_dim):
    """bfloat16 q/k rotated with the float32 tables rounded to bfloat16 and each product and sum
    rounded: bitwise the module's bfloat16 x * cos + rotate_half(x) * sin."""
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, 512)
    heads, kv_heads, tokens = 6, 2, 37
    qkv = _randn(tokens, heads + 2 * kv_heads, head_dim, seed=head_dim, scale=4.0).bfloat16()
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(3))
    qk = qkv[:, : heads + kv_heads]
    expected = rope.rotate(qk, positions)
    v_before = qkv[:, heads + kv_heads :].clone()
    native.rotary_(BUILDS[build], qk, rope.cos, rope.sin, positions)
    assert torch.equal(qkv[:, : heads + kv_heads], expected)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("tokens, width", [(9, 1), (9, 7), (9, 8), (9, 16), (130, 704), (3, 1001)])
def test_silu_mul_bf16_matches_torch(build, tokens, width):
    """bfloat16 silu(gate) * up as torch's two bfloat16 ops compute it: silu in float32 rounded to
    bfloat16, then the product rounded. Our exp differs from torch's by float32 ulps, which can
    move silu's rounding by one bfloat16 ulp and the product's by one more: each element within
    two bfloat16 ulps of torch's, and all but a few equal."""
    gate_up = _randn(tokens, 2 * width, seed=width, scale=6.0).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    got = native.silu_mul(BUILDS[build], gate, up)
    expected = F.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp_min(1e-30)
    assert ((got.float() - expected.float()).abs() <= 2 * ulp).all()
    assert (got == expected).float().mean() >= 0.99


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_row_scatter_bf16_equals_index_copy(build):
    kv_heads, slots, head_dim, tokens = 2, 500, 16, 130
    qkv = _randn(tokens, 4 + 2 * kv_heads, head_dim, seed=4).bfloat16()
    k = qkv[:, 4 : 4 + kv_heads]
    index = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[:tokens]
    dst = _randn(kv_heads, slots, head_dim, seed=6).bfloat16()
    expected = dst.clone().index_copy_(1, index, k.transpose(0, 1))
    native.scatter_rows_(BUILDS[build], dst, index, k)
    assert torch.equal(dst, expected)


def test_bf16_native_pieces_match_the_reference_pieces(tmp_path):
    """A bfloat16 engine runs on the native pieces too, and its tokens and log-probs are those of
    the reference pieces (the kernels round where the reference's bfloat16 ops round)."""
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model import CausalLM, DecoderLayer, LayerPieces
    from rollout.native import layers

    from tiny_hf import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("qwen2", seed=0), tmp_path)
    config = EngineConfig(model_path=str(tmp_path), dtype="bfloat16", kv_cache_tokens=2048, seed=0)
    engine = Engine(config)
    assert engine.model.pieces.attention_inputs is layers.attention_inputs
    reference = LayerPieces(
        DecoderLayer.attention_inputs, DecoderLayer.attention_outputs, CausalLM._logits
    )
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=1)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    native_out = engine.generate(prompts, params)
    engine.model.pieces = reference
    engine.flush_prefix_cache()
    reference_out = engine.generate(prompts, params)
    for a, b in zip(native_out, reference_out):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-2, rtol=0
            )


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden", [(1, 8), (5, 20), (300, 256), (3, 1001)])
def test_add_rms_norm_is_the_add_then_the_norm(build, dtype, tokens, hidden):
    """The residual add folded into the norm's pass: x becomes torch's `residual + x` bitwise
    (one rounding of the float32 sum in bfloat16), and the output is bitwise `rms_norm` of that
    sum (the same row code), itself checked against the module above. Strided residual rows are
    read in place."""
    lib = BUILDS[build]
    weight = _randn(hidden, seed=1).to(dtype)
    x = _randn(tokens, hidden, seed=2, scale=3.0).to(dtype)
    residual = _randn(tokens, 2 * hidden, seed=3, scale=5.0).to(dtype)[:, :hidden]
    expected_sum = residual + x
    got = native.add_rms_norm_(lib, x, residual, weight, 1e-6)
    assert torch.equal(x, expected_sum)
    assert torch.equal(got, native.rms_norm(lib, expected_sum, weight, 1e-6))


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchecked_calls_equal_the_checked_ones(build, dtype):
    """The engine's thin calls (no per-call checks) compute what the checked wrappers do:
    bitwise, on the engine's layouts (q/k heads of a fused projection's output, the halves of the
    fused gate/up output)."""
    lib = BUILDS[build]
    tokens, hidden, width, head_dim = 37, 64, 48, 16
    x = _randn(tokens, hidden, seed=1, scale=2.0).to(dtype)
    weight = _randn(hidden, seed=2).to(dtype)
    assert torch.equal(
        native.rms_norm_unchecked(lib, x, weight, 1e-6), native.rms_norm(lib, x, weight, 1e-6)
    )
    gate_up = _randn(tokens, 2 * width, seed=3, scale=4.0).to(dtype)
    expected = native.silu_mul(lib, *gate_up.chunk(2, dim=-1))
    assert torch.equal(native.silu_mul_halves_unchecked(lib, gate_up), expected)
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, 256)
    qkv = _randn(tokens, 8, head_dim, seed=4, scale=3.0).to(dtype)
    positions = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(5))
    expected = qkv.clone()
    native.rotary_(lib, expected[:, :6], rope.cos, rope.sin, positions)
    native.rotary_unchecked_(lib, qkv[:, :6], rope.cos, rope.sin, positions)
    assert torch.equal(qkv, expected)
    with pytest.raises(IndexError):
        native.rotary_unchecked_(lib, qkv[:, :6], rope.cos, rope.sin, positions + 256)
    assert torch.equal(qkv, expected)  # nothing written


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 130, 1100])  # 1100: over the parallel threshold
def test_kv_row_scatter_equals_two_index_copies(build, dtype, tokens):
    """A layer's K and V stores in one call: each destination as its own `index_copy_` makes it,
    from k, v views of one projection's output into a [2, Hkv, N, D] pair (the pool's layout)."""
    kv_heads, slots, head_dim = 2, 1200, 16
    qkv = _randn(tokens, 4 + 2 * kv_heads, head_dim, seed=4).to(dtype)
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    index = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[:tokens]
    dst = _randn(2, kv_heads, slots, head_dim, seed=6).to(dtype)
    expected = dst.clone()
    expected[0].index_copy_(1, index, k.transpose(0, 1))
    expected[1].index_copy_(1, index, v.transpose(0, 1))
    native.scatter_kv_rows_(BUILDS[build], dst[0], dst[1], index, k, v)
    assert torch.equal(dst, expected)
    before = dst.clone()
    with pytest.raises(IndexError):
        native.scatter_kv_rows_(BUILDS[build], dst[0], dst[1], index.flip(0) * 0 + slots, k, v)
    assert torch.equal(dst, before)  # nothing written


def test_the_calls_benchmark_runs(tmp_path):
    """`benchmarks/pointwise_calls.py` end to end at a tiny size (its figures are not asserted:
    speed lives in the benchmark's JSON)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run.json"
    subprocess.run(
        [sys.executable, str(root / "benchmarks/pointwise_calls.py"), "--rounds", "2", "--rows",
         "1", "5", "--pool-slots", "256", "--evict-mib", "1", "--threads", "1", "--out", str(out)],
        check=True, capture_output=True, cwd=root,
    )  # fmt: skip
    cells = json.loads(out.read_text())["result"]["cells"]
    assert {(c["dtype"], c["rows"]) for c in cells} == {
        (d, r) for d in ("bfloat16", "float32") for r in (1, 5)
    }
    assert all(c["old_us_median"] > 0 and c["new_us_median"] > 0 for c in cells)
