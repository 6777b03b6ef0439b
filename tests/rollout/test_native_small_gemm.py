"""The small-batch linear kernel (`rollout/native/small_gemm.c`, `native.small_linear`) against
float64 products and torch's own F.linear / addmm on the same inputs, in the vector (AVX-512)
and the portable build; and the native model pieces' use of it (`rollout.native.layers`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_builds import builds

from rollout import native
from rollout.native import layers

pytestmark = pytest.mark.skipif(
    native.small_gemm() is None, reason="no C compiler: the engine multiplies in torch"
)

BUILDS = builds(native.small_gemm)
assert "portable" not in BUILDS or BUILDS["portable"].small_gemm_has_avx512() == 0
if BUILDS["native"].small_gemm_has_amx():
    # the AVX-512 path the AMX tiles replace for bfloat16, kept tested on a CPU with them
    BUILDS["no_amx"] = native.small_gemm.build(native.NO_AMX_FLAGS)
    assert BUILDS["no_amx"].small_gemm_has_amx() == 0

# every 4-row tile remainder, 16-row AMX tile counts and remainders (1..4 C tiles, a second
# pass of 64 rows), the thresholds and beyond
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 48, 64, 65]
SHAPES = [(1, 1), (3, 7), (4, 16), (5, 17), (17, 33), (64, 256), (131, 300), (384, 256)]
U32 = 2.0**-24  # float32 unit roundoff


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _strided(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t's values in a view whose rows are `extra` elements further apart."""
    wide = torch.full((t.shape[0], t.shape[1] + extra), float("nan"), dtype=t.dtype)
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("outs,inner", SHAPES)
def test_float32_matches_float64_and_torch(build, rows, outs, inner):
    """float32 x W^T (+ bias, + residual) within the summation-error bound of float64 products:
    each output is a chain of at most K float32 multiply-adds plus the bias and residual adds
    and a 16-lane tree (<= K + 8 roundings: the portable build sums in K order, the vector one in
    16 lanes of K / 16 then the tree), so |error| <= (K + 8) u sum|terms| (u = 2^-24). A wrong
    or missing term is off by O(|term|), far outside it. torch's GEMM obeys the same bound."""
    lib = BUILDS[build]
    x, w = _randn(rows, inner, seed=1), _randn(outs, inner, seed=2)
    bias, residual = _randn(outs, seed=3), _randn(rows, outs, seed=4)
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = native.small_linear(lib, x, w, b, r)
        ref = x.double() @ w.double().t()
        magnitude = x.double().abs() @ w.double().abs().t()
        if b is not None:
            ref, magnitude = ref + b.double(), magnitude + b.double().abs()
        if r is not None:
            ref, magnitude = ref + r.double(), magnitude + r.double().abs()
        bound = (inner + 8) * U32 * magnitude + 1e-37
        assert got.shape == (rows, outs) and got.dtype == torch.float32
        assert ((got.double() - ref).abs() <= bound).all()
        expected = F.linear(x, w, b) if r is None else torch.addmm(r, x, w.t(), beta=1)
        if r is not None and b is not None:
            expected = r + F.linear(x, w, b)
        assert ((got.double() - expected.double()).abs() <= 2 * bound).all()


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |t| (8 significant bits)."""
    exponent = torch.floor(torch.log2(t.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("outs,inner", SHAPES)
def test_bfloat16_within_one_ulp_and_residual_as_torch_adds_it(build, rows, outs, inner):
    """bfloat16 x W^T + bias: the float32-accumulated sum rounded once, so within one bfloat16
    ulp of the float32 reference (round to nearest is half an ulp; the rest covers the float32
    summation order) plus both float32 sums' error bound (the test above's; it matters only
    where the terms cancel to a result far smaller than they are); almost always torch's
    bfloat16 F.linear bit for bit. With a residual:
    exactly torch's `residual + product` of the kernel's own rounded product (the add rounds
    again, after the product's rounding, as the reference rounds)."""
    lib = BUILDS[build]
    x, w = _randn(rows, inner, seed=1).bfloat16(), _randn(outs, inner, seed=2).bfloat16()
    bias, residual = _randn(outs, seed=3).bfloat16(), _randn(rows, outs, seed=4).bfloat16()
    for b in (None, bias):
        product = native.small_linear(lib, x, w, b)
        assert product.dtype == torch.bfloat16 and product.shape == (rows, outs)
        ref32 = F.linear(x.float(), w.float(), None if b is None else b.float())
        magnitude = F.linear(
            x.float().abs(), w.float().abs(), None if b is None else b.float().abs()
        )
        summation = 2 * (inner + 8) * U32 * magnitude.double()
        assert ((product.float() - ref32).abs() <= _bf16_ulp(ref32) + summation).all()
        assert (product == F.linear(x, w, b)).float().mean() >= 0.98
        with_residual = native.small_linear(lib, x, w, b, residual)
        assert torch.equal(with_residual, residual + product)


@pytest.mark.skipif("no_amx" not in BUILDS, reason="no AMX tiles here")
# up to the engine's limit on AMX (layers.SMALL_LINEAR_ROWS_AMX): several 64-row passes
@pytest.mark.parametrize("rows", ROWS + [128, 200, 256])
@pytest.mark.parametrize("outs,inner", SHAPES + [(48, 64), (40, 95), (272, 4000)])
def test_amx_tiles_and_avx512_agree_within_the_bound(rows, outs, inner):
    """The AMX build's bfloat16 products (from 8 rows: tiles for whole 16 outputs, the AVX-512
    path for the rest; K past the last whole 32 from a zero-padded staging tile) and the
    no-AMX build's:
    both the float32 sum rounded once, so each within one bfloat16 ulp (of the float64 result)
    plus both float32 summation bounds of the float64 reference, hence within two ulps plus
    twice that of each other; bias and residual as in the test above, rows of x strided."""
    x = _strided(_randn(rows, inner, seed=5).bfloat16(), 7)
    w = _randn(outs, inner, seed=6).bfloat16()
    bias, residual = _randn(outs, seed=7).bfloat16(), _randn(rows, outs, seed=8).bfloat16()
    ref = x.double() @ w.double().t() + bias.double()
    magnitude = x.double().abs() @ w.double().abs().t() + bias.double().abs()
    summation = 2 * (inner + 8) * U32 * magnitude
    products = {}
    for build in ("native", "no_amx"):
        got = native.small_linear(BUILDS[build], x, w, bias)
        assert ((got.double() - ref).abs() <= _bf16_ulp(ref.float()).double() + summation).all()
        assert torch.equal(native.small_linear(BUILDS[build], x, w, bias, residual), residual + got)
        products[build] = got.double()
    gap = (products["native"] - products["no_amx"]).abs()
    assert (gap <= 2 * _bf16_ulp(ref.float()).double() + 2 * summation).all()


@pytest.mark.skipif("no_amx" not in BUILDS, reason="no AMX tiles here")
@pytest.mark.parametrize("rows", [16, 40, 128])
def test_amx_rounds_nan_and_denormal_sums_as_torch(rows):
    """The AMX path rounds its C tiles with vcvtne2ps2bf16, which keeps a NaN's sign and payload
    and flushes denormals to zero; a tile holding either is rounded again bf16_round's way.
    Exact sums (small integers) with NaN rows (a NaN and a -NaN in x) and denormal outputs (a
    denormal bias over a zero row of x): bitwise the float64 result rounded by torch (denormals
    to nearest), NaN rows the one quiet NaN 0x7FC0 that bf16_round (and the kernel before the
    instruction) gives whatever the NaN's sign (torch's own conversion keeps it)."""
    x = torch.randint(-3, 4, (rows, 64), generator=torch.Generator().manual_seed(1))
    w = torch.randint(-3, 4, (48, 64), generator=torch.Generator().manual_seed(2))
    bias = torch.randint(-3, 4, (48,), generator=torch.Generator().manual_seed(3)).float()
    bias[::3] = torch.linspace(-3e-39, 3e-39, 16)  # bfloat16 denormals (below 2^-126)
    x, w, bias = x.bfloat16(), w.bfloat16(), bias.bfloat16()
    x[3] = 0  # row 3: the bias alone
    x[5, 7], x[9, 2] = float("nan"), -float("nan")
    ref = (x.double() @ w.double().t() + bias.double()).float().bfloat16()
    got = native.small_linear(BUILDS["native"], x, w, bias)
    assert (got[3, ::3] != 0).all() and (got[3, ::3].float().abs() < 2.0**-126).all()
    nan_rows = torch.zeros(rows, dtype=torch.bool)
    nan_rows[[5, 9]] = True
    assert (got[nan_rows].view(torch.int16) == 0x7FC0).all()
    assert torch.equal(got[~nan_rows].view(torch.int16), ref[~nan_rows].view(torch.int16))


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_threads_split_the_rows_without_changing_them(build):
    """From 4 16-row tiles a thread the AMX path's threads split x's rows (each all outputs of
    its rows; the outputs past the last whole 16 on the AVX-512 path per row range): 2 and 3
    threads give the one-thread bits, with bias, residual, strided x and a ragged N."""
    lib = BUILDS[build]
    before = torch.get_num_threads()
    for rows in (128, 200, 300):
        x = _strided(_randn(rows, 200, seed=1).bfloat16(), 5)
        w = _randn(147, 200, seed=2).bfloat16()
        bias, residual = _randn(147, seed=3).bfloat16(), _randn(rows, 147, seed=4).bfloat16()
        try:
            torch.set_num_threads(1)
            alone = native.small_linear(lib, x, w, bias, residual)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(native.small_linear(lib, x, w, bias, residual), alone)
        finally:
            torch.set_num_threads(before)


def _cpu_vendor() -> str | None:
    """The CPU's vendor as Linux reports it (None elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def test_cpu_vendor_is_the_kernels():
    """small_gemm_cpu_is_intel (which routes float32's 17..256-row GEMMs) agrees with the vendor
    the kernel of the OS reports."""
    vendor = _cpu_vendor()
    if vendor is None or native.small_gemm() is None:
        pytest.skip("no /proc/cpuinfo or no kernel here")
    assert bool(native.small_gemm().small_gemm_cpu_is_intel()) == (vendor == "GenuineIntel")


def test_onednn_takes_float32_rows_past_the_kernel_where_the_cpu_is_not_intel(monkeypatch):
    """Past the kernel's rows, float32 goes to oneDNN exactly where the CPU is not Intel's (and
    torch has oneDNN): the same function as the reference `residual + F.linear(x, w, b)` within
    float32's summation bound of the float64 result, with a bias, a residual, the residual
    overwritten in place, K and N not multiples of any block."""
    vendor = _cpu_vendor()
    if vendor is None or layers._small_gemm(torch.float32) is None:
        pytest.skip("no /proc/cpuinfo or no vector kernel here")
    onednn = layers.onednn_float32_gemm()
    expected_on = vendor != "GenuineIntel" and torch.backends.mkldnn.is_available()
    assert (onednn is not None) == expected_on
    calls = []
    if onednn is not None:
        monkeypatch.setattr(
            layers, "onednn_float32_gemm", lambda: lambda *a: calls.append(a[0].shape) or onednn(*a)
        )
    limit = layers.small_linear_rows(torch.float32)
    w, bias = _randn(131, 300, seed=12), _randn(131, seed=13)
    for rows in (limit + 1, limit + 733):
        x, residual = _randn(rows, 300, seed=rows), _randn(rows, 131, seed=14)
        ref = x.double() @ w.double().t() + bias.double() + residual.double()
        magnitude = (
            x.double().abs() @ w.double().abs().t() + bias.double().abs() + residual.double().abs()
        )
        kept = residual.clone()
        got = layers._linear(x, w, bias, residual)
        assert torch.equal(residual, kept)
        assert ((got.double() - ref).abs() <= (300 + 8) * 2.0**-24 * magnitude).all()
        inplace = layers._linear(x, w, bias, residual, overwrite_residual=True)
        assert torch.equal(inplace, got)
        if onednn is not None:
            assert inplace.data_ptr() == residual.data_ptr()
    assert len(calls) == (4 if onednn is not None else 0)


# float32 outer products (small_gemm.c, fp32_gemm) from 17 rows: around the 16-row blocks and
# the 64-row groups of 6 x 4 tiles (and each 1..3-block remainder group), up to past 256
FP32_OUTER_ROWS = [17, 31, 32, 33, 48, 63, 64, 65, 127, 200, 256, 300]


@pytest.mark.parametrize("rows", FP32_OUTER_ROWS)
@pytest.mark.parametrize("outs,inner", [(1, 1), (5, 17), (37, 95), (131, 300), (256, 704)])
def test_float32_outer_products_within_the_bound(rows, outs, inner):
    """The outer-product path: each output one chain of K float32 multiply-adds in k order, then
    the bias and residual adds (<= K + 2 roundings), so within (K + 8) u sum|terms| of the
    float64 result as above; ragged outputs (not whole 6/8/12/14-output tiles, not whole
    16-output thread ranges), K not a multiple of the 16-step packing, rows of x strided; one
    and two threads bit for bit (the chain does not depend on who computes it)."""
    lib = BUILDS["native"]
    x = _strided(_randn(rows, inner, seed=11), 3)
    w = _strided(_randn(outs, inner, seed=12), 5)
    bias, residual = _randn(outs, seed=13), _randn(rows, outs, seed=14)
    ref = x.double() @ w.double().t() + bias.double() + residual.double()
    magnitude = (
        x.double().abs() @ w.double().abs().t() + bias.double().abs() + residual.double().abs()
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native.small_linear(lib, x, w, bias, residual)
        plain = native.small_linear(lib, x, w)
        torch.set_num_threads(2)
        split = native.small_linear(lib, x, w, bias, residual)
    finally:
        torch.set_num_threads(threads)
    assert ((alone.double() - ref).abs() <= (inner + 8) * U32 * magnitude + 1e-37).all()
    plain_ref = x.double() @ w.double().t()
    plain_bound = (inner + 8) * U32 * (x.double().abs() @ w.double().abs().t()) + 1e-37
    assert ((plain.double() - plain_ref).abs() <= plain_bound).all()
    assert torch.equal(alone, split)


# bfloat16 outer products (small_gemm.c, bf16_outer_gemm) from 32 rows where there are no AMX
# tiles: around the 16-row tiles, the 64-row groups and each 1..3-tile remainder group, up to
# past the engine's limit there (layers.SMALL_LINEAR_ROWS_BF16_NOT_INTEL)
BF16_OUTER_ROWS = [31, 32, 33, 47, 48, 63, 64, 65, 127, 128, 129, 200]


@pytest.mark.skipif(
    not BUILDS["native"].small_gemm_has_bf16_dot() or BUILDS["native"].small_gemm_has_amx(),
    reason="the bfloat16 outer products run where vdpbf16ps exists and AMX tiles do not",
)
@pytest.mark.parametrize("rows", BF16_OUTER_ROWS)
@pytest.mark.parametrize("outs,inner", [(1, 1), (5, 17), (37, 95), (131, 300), (256, 704)])
def test_bfloat16_outer_products_within_one_ulp(rows, outs, inner):
    """The bfloat16 outer-product path: each output's float32 sum (+ bias) rounded once, so within
    one bfloat16 ulp of the float64 result plus the float32 summation bound (each pair's two
    exact products added in k order: <= K + 8 roundings); the residual added to that rounded
    product and rounded again, exactly torch's `residual + product`; odd K (the last value a
    pair with zero), ragged outputs (not whole 6/8/12/14-output tiles), rows of x and of the
    weight strided; one and two threads bit for bit. Against torch's bfloat16 F.linear: bit for
    bit almost everywhere (it rounds the same float32 sums, summed in another order)."""
    lib = BUILDS["native"]
    x = _strided(_randn(rows, inner, seed=21).bfloat16(), 3)
    w = _strided(_randn(outs, inner, seed=22).bfloat16(), 5)
    bias, residual = _randn(outs, seed=23).bfloat16(), _randn(rows, outs, seed=24).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native.small_linear(lib, x, w, bias)
        plain = native.small_linear(lib, x, w)
        with_residual = native.small_linear(lib, x, w, bias, residual)
        torch.set_num_threads(2)
        split = native.small_linear(lib, x, w, bias)
    finally:
        torch.set_num_threads(threads)
    for got, b in ((alone, bias), (plain, None)):
        ref = x.double() @ w.double().t() + (0 if b is None else b.double())
        magnitude = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
        bound = _bf16_ulp(ref.float()).double() + (inner + 8) * U32 * magnitude
        assert ((got.double() - ref).abs() <= bound).all()
        assert (got == F.linear(x, w, b)).float().mean() >= 0.98
    assert torch.equal(with_residual, residual + alone)
    assert torch.equal(alone, split)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_views_are_read_in_place(build, dtype):
    """Rows of x, of the weight and of the residual further apart than their lengths (a slice
    of a wider tensor, as the fused projections' parameters are): the same result as on
    contiguous copies, bit for bit."""
    lib = BUILDS[build]
    x, w = _randn(6, 40, seed=1).to(dtype), _randn(70, 40, seed=2).to(dtype)
    bias, residual = _randn(70, seed=3).to(dtype), _randn(6, 70, seed=4).to(dtype)
    sx, sw, sr = _strided(x, 9), _strided(w, 24), _strided(residual, 5)
    assert not (sx.is_contiguous() or sw.is_contiguous() or sr.is_contiguous())
    got = native.small_linear(lib, sx, sw, bias, sr)
    assert torch.equal(got, native.small_linear(lib, x, w, bias, residual))
    assert not got.isnan().any()


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_the_outputs_without_changing_them(build, dtype):
    """Several threads (each a contiguous range of whole 4-output tiles; 3 threads over 37
    tiles: uneven ranges, a ragged last tile) give the one-thread result bit for bit: each
    output is computed the same way whoever computes it."""
    lib = BUILDS[build]
    x, w = _randn(9, 200, seed=1).to(dtype), _randn(147, 200, seed=2).to(dtype)
    bias, residual = _randn(147, seed=3).to(dtype), _randn(9, 147, seed=4).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native.small_linear(lib, x, w, bias, residual)
        torch.set_num_threads(3)
        split = native.small_linear(lib, x, w, bias, residual)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)


def test_a_column_major_weight_is_not_a_target():
    """The kernel reads each output's weights as one contiguous run: a transposed weight
    (`CausalLM.column_major`) stays on torch's path."""
    x, w = _randn(4, 32), _randn(48, 32)
    assert native.small_linear_target(x, w)
    assert not native.small_linear_target(x, w.t().contiguous().t())
    assert not native.small_linear_target(x, w.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_use_the_kernel_up_to_the_threshold(monkeypatch, dtype):
    """`layers._linear`: the kernel for at most `small_linear_rows(dtype)` rows (where it is
    built with its vector code; more in bfloat16 on AMX tiles), torch's GEMM for more; the same
    function either way (float32: within a summation bound; bfloat16: within an ulp of each of
    its two roundings)."""
    if layers._small_gemm(dtype) is None:
        pytest.skip("the kernel's vector code is not built here")
    calls = []
    real = native.small_linear_unchecked
    monkeypatch.setattr(
        native, "small_linear_unchecked", lambda *a: calls.append(a[1].shape) or real(*a)
    )
    w, bias = _randn(96, 64, seed=2).to(dtype), _randn(96, seed=3).to(dtype)
    limit = layers.small_linear_rows(dtype)
    amx = dtype == torch.bfloat16 and native.small_gemm().small_gemm_has_amx()
    not_intel = _cpu_vendor() not in ("GenuineIntel", None)
    expected = (
        layers.SMALL_LINEAR_ROWS_AMX
        if amx
        else layers.SMALL_LINEAR_ROWS_FP32_NOT_INTEL
        if dtype == torch.float32 and not_intel
        else layers.SMALL_LINEAR_ROWS_BF16_NOT_INTEL
        if dtype == torch.bfloat16 and not_intel
        else layers.SMALL_LINEAR_ROWS
    )
    assert limit == expected
    for rows in (1, 5, limit, limit + 1):
        x, residual = _randn(rows, 64, seed=rows).to(dtype), _randn(rows, 96, seed=9).to(dtype)
        calls.clear()
        got = layers._linear(x, w, bias, residual)
        assert len(calls) == (rows <= limit)
        product = x.double() @ w.double().t() + bias.double()
        ref = residual.double() + product
        if dtype == torch.bfloat16:  # the product rounded, then the sum: an ulp of each
            tol = _bf16_ulp(product.float()) + _bf16_ulp(ref.float())
        else:
            tol = 1e-5 * (residual.double().abs() + product.abs()) + 1e-6
        assert ((got.double() - ref).abs() <= tol).all()


def test_float32_residual_add_into_the_residual_is_addmm_bitwise():
    """`layers._linear(..., overwrite_residual=True)` at torch-GEMM sizes (float32, no bias): the
    sum lands in the residual's own storage and is bitwise torch.addmm's (the same GEMM with
    beta = 1, minus addmm's copy of the residual; on oneDNN, where it takes these rows, its
    product plus the residual); without the flag the residual is untouched."""
    w = _randn(96, 64, seed=2)
    limit = layers.small_linear_rows(torch.float32)
    onednn = layers.onednn_float32_gemm()
    for rows in (limit + 1, limit + 112, limit + 300):
        x, residual = _randn(rows, 64, seed=rows), _randn(rows, 96, seed=9)
        if onednn is None:
            expected = torch.addmm(residual, x, w.t())
        else:  # oneDNN's rounded product, then the add
            expected = residual + onednn(x, w, None, "none", [], "")
        kept = residual.clone()
        assert torch.equal(layers._linear(x, w, None, residual), expected)
        assert torch.equal(residual, kept)
        got = layers._linear(x, w, None, residual, overwrite_residual=True)
        assert got.data_ptr() == residual.data_ptr()
        assert torch.equal(got, expected)
        product = x.double() @ w.double().t()
        ref = kept.double() + product
        tol = 1e-5 * (kept.double().abs() + product.abs()) + 1e-6  # the sibling test's bound
        assert ((got.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_decode_steps_run_on_the_kernel(tmp_path, monkeypatch, dtype):
    """A CPU engine on the native pieces sends its decode steps' linear layers (few rows) to the
    kernel and its prefill (many rows) to torch, and generates the same tokens as the
    reference pieces (float32: logprobs to float32 rounding)."""
    if layers._small_gemm(getattr(torch, dtype)) is None:
        pytest.skip("the kernel's vector code is not built here")
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model import CausalLM, DecoderLayer, LayerPieces

    from tiny_hf import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("qwen2", seed=0), tmp_path)
    engine = Engine(
        EngineConfig(model_path=str(tmp_path), kv_cache_tokens=2048, seed=0, dtype=dtype)
    )
    assert engine.model.pieces.attention_inputs is layers.attention_inputs
    rows = []
    real = native.small_linear_unchecked
    monkeypatch.setattr(
        native, "small_linear_unchecked", lambda *a: rows.append(a[1].shape[0]) or real(*a)
    )
    # 2 prompts x 4 samples: decode steps of 8 rows, prefills of 11 and 37 tokens
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    native_out = engine.generate(prompts, params)
    assert rows and max(rows) <= layers.small_linear_rows(getattr(torch, dtype))
    engine.model.pieces = LayerPieces(
        DecoderLayer.attention_inputs, DecoderLayer.attention_outputs, CausalLM._logits
    )
    engine.flush_prefix_cache()
    reference_out = engine.generate(prompts, params)
    for a, b in zip(native_out, reference_out):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            if dtype == "float32":
                torch.testing.assert_close(
                    torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-5, rtol=0
                )


def test_the_benchmark_runs(tmp_path):
    """`benchmarks/small_gemm.py` end to end at a tiny size (its figures are not asserted: speed
    lives in the benchmark's JSON)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if layers._small_gemm(torch.float32) is None:
        pytest.skip("the benchmark times the kernel's vector code, not built here")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run.json"
    subprocess.run(
        [sys.executable, str(root / "benchmarks/small_gemm.py"), "--rounds", "2", "--rows", "1",
         "5", "--layers", "1", "--evict-mib", "1", "--threads", "1", "--out", str(out)],
        check=True, capture_output=True, cwd=root,
    )  # fmt: skip
    cells = json.loads(out.read_text())["result"]["cells"]
    assert {(c["dtype"], c["rows"], c["weights"]) for c in cells} == {
        (d, r, w) for d in ("float32", "bfloat16") for r in (1, 5) for w in ("cached", "evicted")
    }
    assert all(c["torch_us_median"] > 0 and c["kernel_us_median"] > 0 for c in cells)


# The pointwise build whose row kernels (bf16_rows.h) each small_gemm build compiles in: the
# no-AMX build differs from the native one in AMX only, which the row kernels do not use.
POINTWISE = builds(native.pointwise)
PREPARED_ROWS = [1, 3, 4, 7, 8, 13, 16, 17, 33, 64, 65, 128, 200, 300]
PREPARED_SHAPES = [(3, 7), (16, 16), (17, 33), (40, 95), (64, 256), (131, 300)]


def _pointwise_for(build: str):
    return POINTWISE["portable" if build == "portable" else "native"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("rows", PREPARED_ROWS)
@pytest.mark.parametrize("outs,inner", PREPARED_SHAPES)
def test_prepared_rms_norm_is_the_separate_calls_bitwise(build, rows, outs, inner):
    """small_linear_rms_norm (the norm computed in the multiply's call) is bitwise rms_norm
    then small_linear: the same row code (bf16_rows.h) and the same multiply of the same rows.
    Both separate kernels are tested against torch (test_native_pointwise.py, above), so
    exact equality is the claim; a wrong norm, stride or operand would change bits."""
    lib, pw = BUILDS[build], _pointwise_for(build)
    x = (_randn(rows, inner, seed=1) * 3).to(torch.bfloat16)
    norm_w = (1 + _randn(inner, seed=5) / 4).to(torch.bfloat16)
    w = _randn(outs, inner, seed=2).to(torch.bfloat16)
    bias, residual = _randn(outs, seed=3).to(torch.bfloat16), _randn(rows, outs, seed=4)
    residual = residual.to(torch.bfloat16)
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = native.small_linear_rms_norm(lib, x, norm_w, 1e-6, w, b, r)
        ref = native.small_linear(lib, native.rms_norm(pw, x, norm_w, 1e-6), w, b, r)
        assert _same_bits(got, ref)
    # rows read at their own stride
    wide = _strided(x, 5)
    got = native.small_linear_rms_norm(lib, wide, norm_w, 1e-6, w)
    assert _same_bits(got, native.small_linear(lib, native.rms_norm(pw, x, norm_w, 1e-6), w))


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("rows", PREPARED_ROWS)
@pytest.mark.parametrize("outs,inner", PREPARED_SHAPES)
def test_prepared_silu_mul_is_the_separate_calls_bitwise(build, rows, outs, inner):
    """small_linear_silu_mul of gate_up [M, 2 K] is bitwise silu_mul of its halves then
    small_linear (as above: the same row code and multiply)."""
    lib, pw = BUILDS[build], _pointwise_for(build)
    gate_up = (_randn(rows, 2 * inner, seed=1) * 3).to(torch.bfloat16)
    w = _randn(outs, inner, seed=2).to(torch.bfloat16)
    bias = _randn(outs, seed=3).to(torch.bfloat16)
    residual = _randn(rows, outs, seed=4).to(torch.bfloat16)
    hidden = native.silu_mul(pw, gate_up[:, :inner], gate_up[:, inner:])
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = native.small_linear_silu_mul(lib, gate_up, w, b, r)
        assert _same_bits(got, native.small_linear(lib, hidden, w, b, r))
    got = native.small_linear_silu_mul(lib, _strided(gate_up, 3), w, bias, residual)
    assert _same_bits(got, native.small_linear(lib, hidden, w, bias, residual))


def test_engine_prepared_calls_change_no_bits(tmp_path, monkeypatch):
    """A bfloat16 engine on the native pieces with the element-wise steps in the multiplies'
    calls (`layers._prepared_kernel`) generates bitwise what it does with them as separate
    calls: the same tokens and log-probs; its decode steps make the prepared calls."""
    if layers._small_gemm(torch.bfloat16) is None:
        pytest.skip("the kernel's vector code is not built here")
    from rollout import Engine, EngineConfig, SamplingParams

    from tiny_hf import make_hf_model, save_hf_model

    save_hf_model(make_hf_model("qwen2", seed=0), tmp_path)
    engine = Engine(
        EngineConfig(model_path=str(tmp_path), kv_cache_tokens=2048, seed=0, dtype="bfloat16")
    )
    prepared = []
    real = native.small_linear_prepared_unchecked
    monkeypatch.setattr(
        native,
        "small_linear_prepared_unchecked",
        lambda *a: prepared.append(a[1]) or real(*a),
    )
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    fused = engine.generate(prompts, params)
    assert {native.PREPARE_RMS_NORM, native.PREPARE_SILU_MUL} <= set(prepared)
    monkeypatch.setattr(layers, "_prepared_kernel", lambda *a: None)
    engine.flush_prefix_cache()
    prepared.clear()
    separate = engine.generate(prompts, params)
    assert not prepared
    for a, b in zip(fused, separate):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_prepared_threads_change_no_bits(build):
    """On 2 threads (the transform and, on AMX tiles, the pack split over them) the prepared
    calls give the bits of the separate calls on 1."""
    lib, pw = BUILDS[build], _pointwise_for(build)
    before = torch.get_num_threads()
    for rows, outs, inner in [(128, 1408, 256), (300, 100, 95), (256, 256, 704)]:
        x = _randn(rows, inner, seed=1).to(torch.bfloat16)
        gate_up = _randn(rows, 2 * inner, seed=6).to(torch.bfloat16)
        norm_w = (1 + _randn(inner, seed=5) / 4).to(torch.bfloat16)
        w = _randn(outs, inner, seed=2).to(torch.bfloat16)
        residual = _randn(rows, outs, seed=4).to(torch.bfloat16)
        try:
            torch.set_num_threads(1)
            normed = native.small_linear(lib, native.rms_norm(pw, x, norm_w, 1e-6), w)
            hidden = native.silu_mul(pw, gate_up[:, :inner], gate_up[:, inner:])
            silu = native.small_linear(lib, hidden, w, None, residual)
            torch.set_num_threads(2)
            assert _same_bits(native.small_linear_rms_norm(lib, x, norm_w, 1e-6, w), normed)
            assert _same_bits(native.small_linear_silu_mul(lib, gate_up, w, None, residual), silu)
        finally:
            torch.set_num_threads(before)
