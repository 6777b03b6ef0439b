"""The C decode-attention kernel (`rollout.native`) against the float64 matmul reference
(`cascade_decode_attention_matmul`): its vector (AVX2) build and its portable build, head sizes
with and without an unrolled path, groups with and without a shared prefix, several queries per
sequence, the suffix read in place from a strided view (as the suffix lanes give it)."""

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


def _gathered(k_cache, v_cache, meta, page_size):
    suffix = tuple(_gather(c, meta.suffix_pages, page_size) for c in (k_cache, v_cache))
    prefix = tuple(_gather(c, meta.prefix_pages, page_size) for c in (k_cache, v_cache))
    return suffix, prefix if meta.prefix_pages.shape[1] else None


def _reference(q, k_cache, v_cache, meta, page_size):
    """The matmul path in float64 on the same (float32) values."""
    suffix, prefix = _gathered(k_cache.double(), v_cache.double(), meta, page_size)
    return cascade_decode_attention_matmul(q.double(), meta, suffix, prefix)


def test_the_builds_differ_in_their_vector_path():
    """Guards the test below: the portable build really runs the plain loops."""
    assert BUILDS["native"].cascade_decode_has_avx2() == int("avx2" in open("/proc/cpuinfo").read())
    if "portable" in BUILDS:
        assert BUILDS["portable"].cascade_decode_has_avx2() == 0


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
