"""The transposing copy (`rollout/native/transpose.c`) that fills column-major CPU weights from
the row-major tensors a weight update brings, against torch's own `copy_` of the same tensors:
bitwise equal, every dtype the engine holds, shapes that are and are not multiples of its
tiles and blocks, strided sources and fused destinations; the vector and the portable build;
and `rollout.weights.copy_into` (the path every load takes) choosing it only where it applies."""

from __future__ import annotations

import pytest
import torch
from native_builds import builds

from rollout import native
from rollout.weights import copy_into

pytestmark = pytest.mark.skipif(
    native.transpose() is None, reason="no C compiler: weight loads use torch's copy"
)

BUILDS = builds(native.transpose)
assert "portable" not in BUILDS or BUILDS["portable"].transpose_has_avx2() == 0

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SHAPES = [(1, 1), (1, 9), (9, 1), (7, 13), (8, 8), (64, 256), (300, 37), (513, 1000), (37, 2100)]


def _values(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 100).to(dtype)


def _column_major(rows: int, cols: int, dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
    """[rows + extra, cols] stored as [cols, rows + extra], filled with a sentinel (NaN)."""
    return torch.full((cols, rows + extra), float("nan"), dtype=dtype).t()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaN sentinels compare equal to themselves)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_equals_torch_copy_bitwise(build, dtype, rows, cols):
    """Into the middle rows of a wider column-major tensor (a fused q/k/v weight's slice), from
    a source whose rows are further apart than their length (a narrowed shard): the slice holds
    exactly torch's copy, the rows around it are untouched."""
    whole = _column_major(rows, cols, dtype, extra=5)
    dst = whole[2 : 2 + rows]
    src = _values(rows, cols + 3, dtype)[:, 1 : 1 + cols]
    assert native.transposed_target(dst, src)
    expected = whole.clone()
    expected[2 : 2 + rows].copy_(src)
    native.transpose_copy_(BUILDS[build], dst, src)
    assert torch.equal(_bits(whole), _bits(expected))
    assert whole[:2].isnan().all() and whole[2 + rows :].isnan().all()


@pytest.mark.parametrize("threads", [1, 2])
def test_large_matrix_on_threads(threads):
    """Large enough to be split over OpenMP threads: every block lands where torch puts it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = _values(1030, 700, torch.float32, seed=threads)
        dst = _column_major(1030, 700, torch.float32)
        native.transpose_copy_(native.transpose(), dst, src)
        assert torch.equal(dst, src)
    finally:
        torch.set_num_threads(previous)


def test_copy_into_takes_the_native_path_only_where_it_applies():
    """A column-major CPU weight from a row-major tensor: native; same layouts, another dtype
    (a float32 checkpoint into a bfloat16 engine) or a transposed source: torch's copy. Each
    result equals torch's."""
    src = _values(40, 24, torch.float32)
    cases = {
        "column-major <- row-major": (_column_major(40, 24, torch.float32), src, True),
        "row-major <- row-major": (torch.empty(40, 24), src, False),
        "column-major <- float32 into bfloat16": (
            _column_major(40, 24, torch.bfloat16),
            src,
            False,
        ),
        "column-major <- column-major": (
            _column_major(40, 24, torch.float32),
            src.t().contiguous().t(),
            False,
        ),
    }
    for what, (dst, source, applies) in cases.items():
        assert native.transposed_target(dst, source) == applies, what
        copy_into(dst, source)
        assert torch.equal(dst, source.to(dst.dtype)), what


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dst_shift", [0, 4, 60])
@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 4, (3 << 20) + 68])
def test_stream_copy_equals_torch_copy_bitwise(build, dst_shift, nbytes):
    """The streaming copy of large plain updates: any length (whole cache lines or not) into a
    destination at any 4-byte alignment (a head before the first whole line); the bytes around
    the destination untouched."""
    g = torch.Generator().manual_seed(nbytes + dst_shift)
    src = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), generator=g, dtype=torch.int32)
    src = src.view(torch.float32)  # every bit pattern, NaNs included
    whole = torch.full((nbytes // 4 + 32,), -1, dtype=torch.int32)
    dst = whole[dst_shift // 4 :][: nbytes // 4].view(torch.float32)
    assert native.streamed_target(dst, src)
    native.stream_copy_(BUILDS[build], dst, src)
    assert torch.equal(dst.view(torch.int32), src.view(torch.int32))
    assert (whole[: dst_shift // 4] == -1).all() and (
        whole[dst_shift // 4 + nbytes // 4 :] == -1
    ).all()


def test_copy_into_streams_only_large_plain_copies():
    """Contiguous, same dtype, at least STREAM_COPY_BYTES: streamed; smaller, another dtype or a
    strided side: torch's copy. Each result equals the source."""
    big = native.STREAM_COPY_BYTES // 4
    src = _values(big // 64, 64, torch.float32)
    cases = {
        "large plain": (torch.empty_like(src), src, True),
        "small": (torch.empty(16, 64), src[:16], False),
        "another dtype": (torch.empty(src.shape, dtype=torch.float64), src, False),
        "strided source": (torch.empty(64, src.shape[0]), src.t(), False),
    }
    for what, (dst, source, applies) in cases.items():
        assert native.streamed_target(dst, source) == applies, what
        copy_into(dst, source)
        assert torch.equal(dst, source.to(dst.dtype)), what
