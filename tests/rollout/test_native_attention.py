"""The C decode-attention kernel (`rollout.native`) against the float64 matmul reference
(`cascade_decode_attention_matmul`): its vector (AVX2) build, the same without AMX tiles (on a
CPU that has them) and its portable build, head sizes
with and without an unrolled path, groups with and without a shared prefix, several queries per
sequence, the suffix read in place from a strided view (as the suffix lanes give it), float32
and bfloat16 K/V."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from native_builds import builds
from test_attention import cascade_case

from rollout import native
from rollout.attention import (
    _gather,
    cascade_decode_attention,
    cascade_decode_attention_matmul,
    cascade_decode_attention_native,
)

from kernel_cases import cascade_metadata, random_pool

pytestmark = pytest.mark.skipif(
    native.attention() is None, reason="no C compiler: decode attention uses torch's flash kernel"
)

BUILDS = builds(native.attention)
if BUILDS["native"].cascade_decode_has_amx():
    BUILDS["no_amx"] = native.attention.build(native.NO_AMX_FLAGS)


def _gathered(k_cache, v_cache, meta, page_size, as_stored=False):
    suffix, prefix = (
        tuple(_gather(c, pages, page_size, as_stored=as_stored) for c in (k_cache, v_cache))
        for pages in (meta.suffix_pages, meta.prefix_pages)
    )
    return suffix, prefix if meta.prefix_pages.shape[1] else None


def _reference(q, k_cache, v_cache, meta, page_size):
    """The matmul path in float64 on the same (float32) values."""
    suffix, prefix = _gathered(k_cache.double(), v_cache.double(), meta, page_size)
    return cascade_decode_attention_matmul(q.double(), meta, suffix, prefix)


AMX_MIN_ROWS, AMX_MIN_PREFIX = 16, 256  # cascade_decode.c's thresholds for the AMX prefix path


def _on_amx(lib, head_dim: int, meta) -> bool:
    """Whether `lib` runs a bfloat16 model's groups of at least AMX_MIN_ROWS rows a KV head on
    AMX tiles (the prefix probabilities rounded to bfloat16) at this head size and prefix."""
    return (
        head_dim % 32 == 0
        and head_dim <= 128
        and meta.prefix_bias.shape[1] >= AMX_MIN_PREFIX
        and bool(lib.cascade_decode_has_amx())
    )


def _check_amx(got, q, k_cache, v_cache, meta, page_size):
    """The AMX prefix path against the float64 reference (exact probabilities p_t). Its prefix
    weights are r_t = bfloat16(e_t) (e_t = e^(s_t - m), rounded to nearest: |r_t - e_t| <=
    2^-8 e_t, bfloat16 keeping 8 significant bits) over S' = sum of the r_t and the suffix's
    float32 e_t, so S' = S (1 + D) with |D| <= 2^-8, and each weight r_t / S' = p_t (1 + d_t) /
    (1 + D) lies within 2 * 2^-8 / (1 - 2^-8) p_t < 1.01 * 2^-7 p_t of p_t (a suffix weight
    within 1.01 * 2^-8 p_t): |got - want| <= 1.01 * 2^-7 sum_t p_t |v_t|, plus float32
    rounding (the float32 tests' 2e-6)."""
    want = _reference(q, k_cache, v_cache, meta, page_size)
    scale = _reference(q, k_cache, v_cache.abs(), meta, page_size)  # sum_t p_t |v_t|
    err = (got.double() - want).abs()
    assert (err <= 1.01 * 2.0**-7 * scale + 2e-6 * want.abs() + 2e-6).all(), err.max().item()


def test_the_builds_differ_in_their_vector_path():
    """Guards the test below: the portable build really runs the plain loops."""
    assert BUILDS["native"].cascade_decode_has_avx2() == int("avx2" in open("/proc/cpuinfo").read())
    # the bfloat16 dot path where the CPU has AVX-512 BF16 and no AMX (a core with two 512-bit
    # FMA ports, where FMAs over the widened K are faster: see cascade_decode.c)
    flags = open("/proc/cpuinfo").read().split()
    assert BUILDS["native"].cascade_decode_has_bf16_dot() == int(
        "avx512_bf16" in flags and not {"amx_tile", "amx_bf16"} <= set(flags)
    )
    if "amx_bf16" not in flags:
        assert BUILDS["native"].cascade_decode_has_amx() == 0
    if "no_amx" in BUILDS:  # this CPU has AMX: the no_amx build runs its AVX-512 paths on it
        assert BUILDS["no_amx"].cascade_decode_has_amx() == 0
        assert BUILDS["no_amx"].cascade_decode_has_bf16_dot() == int("avx512_bf16" in flags)
    if "portable" in BUILDS:
        assert BUILDS["portable"].cascade_decode_has_avx2() == 0
        assert BUILDS["portable"].cascade_decode_has_bf16_dot() == 0
        assert BUILDS["portable"].cascade_decode_has_amx() == 0


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [8, 20, 32, 64, 128])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_kernel_matches_the_float64_reference(build, head_dim, page_size):
    """Three groups (3 members over 2 prefix pages, 1 over 1, a sequence with no shared prefix);
    suffixes of 1 to 2 pages + 4 tokens; 1 to 4 queries per sequence, causal among themselves."""
    q, k_cache, v_cache, meta, _ = cascade_case(page_size, seed=head_dim, head_dim=head_dim)
    suffix, prefix = _gathered(k_cache, v_cache, meta, page_size)
    got = cascade_decode_attention_native(BUILDS[build], q, meta, suffix, prefix)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(
        got.double(), _reference(q, k_cache, v_cache, meta, page_size), atol=2e-6, rtol=2e-6
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_strided_suffix_is_read_in_place_with_any_thread_count(threads):
    """Suffix K/V as views into wider per-sequence rows (the lanes' layout) give the same result
    as contiguous copies, whatever the number of threads the items are split over."""
    q, k_cache, v_cache, meta, _ = cascade_case(4, seed=7, head_dim=32)
    suffix, prefix = _gathered(k_cache, v_cache, meta, 4)
    wide = tuple(torch.full((*t.shape[:2], t.shape[2] + 24, t.shape[3]), 7.0) for t in suffix)
    for w, t in zip(wide, suffix):
        w[:, :, : t.shape[2]] = t
    views = tuple(w[:, :, : suffix[0].shape[2]] for w in wide)
    assert not views[0].is_contiguous()
    lib, before = native.attention(), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        in_place = cascade_decode_attention_native(lib, q, meta, views, prefix)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(in_place, cascade_decode_attention_native(lib, q, meta, suffix, prefix))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_ordered_grid_reads_q_in_place_and_returns_token_rows(threads):
    """One query per sequence in batch order (`grid_is_batch`, the engine's steady decode): the
    kernel reads the q heads in place from a wider fused-projection row and its output rows are
    the tokens' rows, bitwise the result of the gathered grid, and within float32 rounding of
    the float64 reference."""
    g = torch.Generator().manual_seed(5)
    page_size, num_kv, per_kv, head_dim = 4, 2, 3, 32
    k_cache, v_cache = random_pool(num_kv, 64, page_size, head_dim, torch.float32, g)
    groups = [(2, [1, 5, 9]), (1, [3]), (0, [6])]
    meta = cascade_metadata(groups, page_size, 64, g)
    num_tokens, heads = meta.num_tokens, num_kv * per_kv
    fused = torch.randn(num_tokens, heads + 2 * num_kv, head_dim, generator=g)
    q = fused[:, :heads]  # the q heads of a q/k/v projection's output: a strided view
    assert not q.is_contiguous()
    suffix, prefix = _gathered(k_cache, v_cache, meta, page_size)
    lib, before = native.attention(), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        in_place = cascade_decode_attention_native(
            lib, q, replace(meta, grid_is_batch=True), suffix, prefix
        )
        gathered = cascade_decode_attention_native(lib, q, meta, suffix, prefix)
    finally:
        torch.set_num_threads(before)
    assert in_place.shape == q.shape and in_place.is_contiguous()
    assert torch.equal(in_place, gathered)
    torch.testing.assert_close(
        in_place.double(),
        _reference(q, k_cache, v_cache, meta, page_size),
        atol=2e-6,
        rtol=2e-6,
    )


def test_the_dispatcher_uses_the_kernel_in_float32_only():
    """float32 on CPU runs the C kernel (bitwise its output); float64 keeps torch's path, within
    1e-13 of the reference."""
    q, k_cache, v_cache, meta, _ = cascade_case(4, seed=3, head_dim=16)
    suffix, prefix = _gathered(k_cache, v_cache, meta, 4)
    dispatched = cascade_decode_attention(q, k_cache, v_cache, meta, 4)
    direct = cascade_decode_attention_native(native.attention(), q, meta, suffix, prefix)
    assert torch.equal(dispatched, direct)
    exact = cascade_decode_attention(q.double(), k_cache.double(), v_cache.double(), meta, 4)
    torch.testing.assert_close(
        exact, _reference(q, k_cache, v_cache, meta, 4), atol=1e-13, rtol=1e-13
    )


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [8, 20, 32, 64, 128])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_bfloat16_kv_are_read_as_stored_bitwise_as_their_float32_widening(
    build, head_dim, page_size
):
    """bfloat16 K/V (prefix and suffix, as a bfloat16 pool holds them) give bitwise the float32
    kernel's result on their exact float32 widening (the kernel widens each row as it reads
    it), and so stay within float32 rounding of the float64 reference."""
    q, k_cache, v_cache, meta, _ = cascade_case(page_size, seed=head_dim, head_dim=head_dim)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    lib = BUILDS[build]
    suffix, prefix = _gathered(k_cache, v_cache, meta, page_size, as_stored=True)
    assert suffix[0].dtype == prefix[0].dtype == torch.bfloat16
    got = cascade_decode_attention_native(lib, q, meta, suffix, prefix)
    widened = _gathered(k_cache.float(), v_cache.float(), meta, page_size)
    assert torch.equal(got, cascade_decode_attention_native(lib, q, meta, *widened))
    torch.testing.assert_close(
        got.double(),
        _reference(q, k_cache.float(), v_cache.float(), meta, page_size),
        atol=2e-6,
        rtol=2e-6,
    )


def test_a_bfloat16_pool_is_gathered_as_stored_for_the_kernel():
    """The dispatcher on a bfloat16 model and pool: the C kernel on the pool's bfloat16 rows
    (no float32 copy), within bfloat16 rounding of the float64 reference."""
    q, k_cache, v_cache, meta, _ = cascade_case(4, seed=9, head_dim=32)
    q, k_cache, v_cache = (x.to(torch.bfloat16) for x in (q, k_cache, v_cache))
    got = cascade_decode_attention(q, k_cache, v_cache, meta, 4)
    assert got.dtype == torch.bfloat16
    suffix, prefix = _gathered(k_cache, v_cache, meta, 4, as_stored=True)
    direct = cascade_decode_attention_native(native.attention(), q, meta, suffix, prefix)
    assert torch.equal(got, direct)
    want = _reference(q.float(), k_cache.float(), v_cache.float(), meta, 4)
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0**-8 + 1e-6  # the output rounded once to bfloat16
    if _on_amx(
        native.attention(), 32, meta
    ):  # and the probabilities (_check_amx): 1.01 * 2^-7 each
        bound += (
            1.01 * 2.0**-7 * _reference(q.float(), k_cache.float(), v_cache.float().abs(), meta, 4)
        )
    assert (err <= bound).all(), err.max().item()


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_the_kernel_shares_torchs_openmp_runtime():
    """Built with -fopenmp, the library must bind to the libgomp torch already loaded (one
    thread pool), not bring a second OpenMP runtime whose threads would contend with torch's."""
    result = _run(
        """
        import torch
        from rollout import native
        assert native.attention() is not None
        maps = open("/proc/self/maps").read().splitlines()
        print(sorted({line.split()[-1] for line in maps if "gomp" in line or "libomp" in line}))
        """
    )
    assert result.returncode == 0, result.stderr
    runtimes = eval(result.stdout.strip())  # noqa: S307 -- our own subprocess's list of paths
    assert len(runtimes) == 1, runtimes


def test_disabled_native_code_falls_back_to_torch_quietly():
    result = _run(
        """
        import torch
        from test_attention import cascade_case
        from rollout import native
        from rollout.attention import cascade_decode_attention
        q, k, v, meta, _ = cascade_case(4)
        out = cascade_decode_attention(q, k, v, meta, 4)
        print(native.attention() is None, out.shape == q.shape)
        """,
        {"MILES_LIKE_NATIVE": "0", "PYTHONPATH": "tests/rollout:tests:."},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
    assert "native decode attention unavailable" not in result.stderr


def _permuted(meta, perm: torch.Tensor):
    """`meta` with its sequences reordered (new sequence i = old sequence perm[i]); the decode
    tokens keep their batch rows. A group's members are then neither consecutive nor in order."""
    num_seqs, width_q = meta.suffix_bias.shape[:2]
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(num_seqs)
    cells = meta.token_cell
    return replace(
        meta,
        member_index=meta.member_index[perm],
        suffix_pages=meta.suffix_pages[perm],
        suffix_bias=meta.suffix_bias[perm],
        query_index=meta.query_index.view(num_seqs, width_q)[perm].reshape(-1),
        token_cell=inverse[cells // width_q] * width_q + cells % width_q,
    )


def _group_case(head_dim: int, page_size: int, seed: int, *, shuffle: bool = True):
    """Groups of unequal sizes sharing prefixes of different lengths (a group of 8, groups of
    1, one of 5 with a longer prefix, one whose prefix is empty while others' are not), 1 to 3
    queries per sequence, the sequences shuffled out of member order."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = random_pool(2, 160, page_size, head_dim, torch.float32, g)
    sizes = [(2, 8), (1, 1), (5, 5), (0, 1), (3, 1)]
    groups = [
        (pages, torch.randint(0, 3 * page_size, (n,), generator=g).tolist()) for pages, n in sizes
    ]
    num_queries = [torch.randint(1, 4, (n,), generator=g).tolist() for _, n in sizes]
    meta = cascade_metadata(groups, page_size, 160, g, num_queries=num_queries)
    if shuffle:
        meta = _permuted(meta, torch.randperm(meta.suffix_bias.shape[0], generator=g))
    q = torch.randn(meta.num_tokens, 2 * 3, head_dim, generator=g)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [20, 24, 32, 40])
@pytest.mark.parametrize("page_size", [4, 16])
def test_groups_of_any_size_and_order_match_the_float64_reference(build, head_dim, page_size):
    """A prefix is shared by all the rows of its group's members (one work item per group and
    KV head), whatever the sequences' order in the batch, the groups' sizes, the number of
    queries per sequence and whether the head size fills whole vectors (24, 40: 32 + 8)."""
    q, k_cache, v_cache, meta = _group_case(head_dim, page_size, seed=head_dim + page_size)
    assert not torch.equal(meta.member_index, meta.member_index.sort().values)
    suffix, prefix = _gathered(k_cache, v_cache, meta, page_size)
    got = cascade_decode_attention_native(BUILDS[build], q, meta, suffix, prefix)
    torch.testing.assert_close(
        got.double(), _reference(q, k_cache, v_cache, meta, page_size), atol=2e-6, rtol=2e-6
    )


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_no_shared_prefix_at_all_matches_the_reference(build):
    """Lp = 0 (no group has a prefix page): one work item per sequence."""
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = random_pool(2, 64, 4, 32, torch.float32, g)
    meta = cascade_metadata([(0, [3, 9]), (0, [0])], 4, 64, g, num_queries=[[1, 2], [3]])
    q = torch.randn(meta.num_tokens, 6, 32, generator=g)
    suffix, prefix = _gathered(k_cache, v_cache, meta, 4)
    assert prefix is None
    got = cascade_decode_attention_native(BUILDS[build], q, meta, suffix, prefix)
    torch.testing.assert_close(
        got.double(), _reference(q, k_cache, v_cache, meta, 4), atol=2e-6, rtol=2e-6
    )


def _same_for_any_thread_count(lib, q, meta, suffix, prefix) -> torch.Tensor:
    """The kernel's output at 1, 2, 3 and 8 threads, asserted bitwise the same (each output
    element is computed the same way whichever thread computes it); returns it."""
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            outs.append(cascade_decode_attention_native(lib, q, meta, suffix, prefix))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert torch.equal(other, outs[0])
    return outs[0]


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_a_large_group_is_split_over_threads_with_bitwise_equal_results(build):
    """One group of 24 members: with more threads its members are cut into shorter runs (work
    items), which changes how rows are blocked but no row's result, bit for bit."""
    g = torch.Generator().manual_seed(12)
    k_cache, v_cache = random_pool(2, 128, 4, 32, torch.float32, g)
    meta = cascade_metadata(
        [(5, torch.randint(0, 9, (24,), generator=g).tolist()), (2, [4])], 4, 128, g
    )
    q = torch.randn(meta.num_tokens, 6, 32, generator=g)
    suffix, prefix = _gathered(k_cache, v_cache, meta, 4)
    lib = BUILDS[build]
    out = _same_for_any_thread_count(lib, q, meta, suffix, prefix)
    torch.testing.assert_close(
        out.double(), _reference(q, k_cache, v_cache, meta, 4), atol=2e-6, rtol=2e-6
    )


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [20, 32, 64, 128])
@pytest.mark.parametrize("page_size", [4, 16])
def test_a_bfloat16_models_q_scores_the_prefix_through_bfloat16_dot_products(
    build, head_dim, page_size
):
    """q whose values are all bfloat16 (a bfloat16 model's, widened) against a bfloat16 pool:
    where the build uses them (AVX-512 BF16, no AMX) the prefix scores are bfloat16 dot
    products, each product the float32 kernel's exact one and only the summation order
    different (elsewhere the float32 kernel's FMAs over the widened K), so the output stays
    within float32 rounding of the float64 reference (the float32 tests' bound); with AMX, groups
    of 16 rows or more take the tiles (_check_amx's bound). Either way bitwise the same for any
    number of threads, and stale K under masked keys never matters."""
    q, k_cache, v_cache, meta = _group_case(head_dim, page_size, seed=head_dim + page_size)
    q = q.bfloat16().float()
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    lib = BUILDS[build]
    suffix, prefix = _gathered(k_cache, v_cache, meta, page_size, as_stored=True)
    out = _same_for_any_thread_count(lib, q, meta, suffix, prefix)
    if _on_amx(lib, head_dim, meta):  # the group of 8 (and of 5) on AMX tiles
        _check_amx(out, q, k_cache.float(), v_cache.float(), meta, page_size)
    else:
        want = _reference(q, k_cache.float(), v_cache.float(), meta, page_size)
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    widened = _gathered(k_cache.float(), v_cache.float(), meta, page_size)
    float32_kernel = cascade_decode_attention_native(lib, q, meta, *widened)
    # the dot path (or the tiles) really ran where the CPU has it: other last bits
    differs = bool(lib.cascade_decode_has_bf16_dot()) or _on_amx(lib, head_dim, meta)
    assert torch.equal(out, float32_kernel) != differs
    pk = prefix[0].clone()
    masked = torch.isneginf(meta.prefix_bias)
    assert masked.any()
    pk[:, masked] = torch.tensor([3e38, -3e38]).repeat(head_dim // 2).bfloat16()
    dirty = cascade_decode_attention_native(lib, q, meta, suffix, (pk, prefix[1]))
    assert torch.equal(dirty, out)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [20, 32])
def test_stale_values_under_masked_keys_never_matter(build, head_dim):
    """K and V of keys masked for every row of a sequence (padding pages, a suffix's tail, a
    group's empty prefix) may hold any finite values, even ones whose dot products overflow:
    the output is bitwise the same."""
    q, k_cache, v_cache, meta = _group_case(head_dim, 4, seed=21)
    (sk, sv), (pk, pv) = _gathered(k_cache, v_cache, meta, 4)
    clean = cascade_decode_attention_native(BUILDS[build], q, meta, (sk, sv), (pk, pv))
    suffix_masked = torch.isneginf(meta.suffix_bias).all(1)  # [D, Ls]: masked for every query
    prefix_masked = torch.isneginf(meta.prefix_bias)  # [G, Lp]
    assert suffix_masked.any() and prefix_masked.any()
    huge = torch.tensor([3e38, -3e38]).repeat(head_dim // 2)
    for t, masked in (
        (sk, suffix_masked),
        (sv, suffix_masked),
        (pk, prefix_masked),
        (pv, prefix_masked),
    ):
        t[:, masked] = huge
    dirty = cascade_decode_attention_native(BUILDS[build], q, meta, (sk, sv), (pk, pv))
    assert torch.equal(dirty, clean)


def _threshold_case(head_dim: int, page_size: int, seed: int):
    """A bfloat16 model's decode step (1 query, 4 q heads a KV head: 4 rows a sequence) with
    groups around the AMX threshold of 16 rows a KV head: 3 members (12 rows, the FMA tile), 4
    (16), 8 (32), 10 (40: a padded tile) and 4 with no prefix at all (every prefix key masked);
    prefixes of different lengths (shorter ones masked to the longest, which is past
    AMX_MIN_PREFIX), key counts not multiples of 32. Returns q, the bfloat16 pool, meta and the
    token rows of the small group."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = random_pool(2, 400, page_size, head_dim, torch.float32, g)
    keys = [180, 100, 300, 0, 140]  # prefix keys a group, rounded up to whole pages
    sizes = [(-(-n // page_size), m) for n, m in zip(keys, [3, 4, 8, 4, 10])]
    groups = [
        (pages, torch.randint(0, 3 * page_size, (n,), generator=g).tolist()) for pages, n in sizes
    ]
    meta = cascade_metadata(groups, page_size, 400, g)
    assert meta.prefix_bias.shape[1] >= AMX_MIN_PREFIX
    q = torch.randn(meta.num_tokens, 8, head_dim, generator=g).bfloat16().float()
    small = meta.query_index[: sizes[0][1]]  # sequences in group order, one query each
    return q, k_cache.bfloat16(), v_cache.bfloat16(), meta, small


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("page_size", [4, 16])
def test_bfloat16_groups_of_16_rows_or_more_take_the_amx_tiles(build, head_dim, page_size):
    """Where the build and CPU have AMX, a bfloat16 model's groups of at least 16 rows a KV head
    compute the prefix part on tiles (probabilities rounded to bfloat16: _check_amx's bound
    against the float64 reference) and smaller groups on the FMA tile (bitwise the float32
    kernel on the widened values); elsewhere (no AMX: the fallback) every group is within
    float32 rounding. Either way bitwise the same for any number of threads (runs of a group
    are cut differently; the path is the group's, not the run's), and stale K / V under masked
    prefix keys (huge values whose products overflow) never matter."""
    q, k_cache, v_cache, meta, small = _threshold_case(head_dim, page_size, seed=head_dim)
    lib = BUILDS[build]
    suffix, prefix = _gathered(k_cache, v_cache, meta, page_size, as_stored=True)
    got = _same_for_any_thread_count(lib, q, meta, suffix, prefix)
    widened = _gathered(k_cache.float(), v_cache.float(), meta, page_size)
    float32_kernel = cascade_decode_attention_native(lib, q, meta, *widened)
    if _on_amx(lib, head_dim, meta):
        path = "AMX tiles (groups >= 16 rows), FMA tile (the 12-row group)"
        _check_amx(got, q, k_cache.float(), v_cache.float(), meta, page_size)
        assert torch.equal(got[small], float32_kernel[small])
        big = torch.ones(got.shape[0], dtype=torch.bool)
        big[small] = False
        assert not torch.equal(got[big], float32_kernel[big])  # the tiles really ran
    else:
        path = "fallback without AMX (FMA tile or bfloat16 dots)"
        want = _reference(q, k_cache.float(), v_cache.float(), meta, page_size)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
        if not lib.cascade_decode_has_bf16_dot():
            assert torch.equal(got, float32_kernel)
    print(f"{build} build, head_dim {head_dim}: {path}")
    pk, pv = (t.clone() for t in prefix)
    masked = torch.isneginf(meta.prefix_bias)
    assert masked.any()
    huge = torch.tensor([3e38, -3e38]).repeat(head_dim // 2).bfloat16()
    pk[:, masked], pv[:, masked] = huge, huge
    assert torch.equal(cascade_decode_attention_native(lib, q, meta, suffix, (pk, pv)), got)
