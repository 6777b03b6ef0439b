"""The decode kernels at the shapes a GPU runs them with, interpreted on CPU (see conftest.py):
the GPU's block of 64 tokens (`default_block_n` off the interpreter), head_dim 128 and 80, 28
query heads over 4 K/V heads, 1 and 8 query heads per K/V head, and a page-table width near a
model length where most split-K chunks of most sequences are empty. Each against the torch
reference `rollout.attention.cascade_decode_attention`.

The merge kernel's tile of partial outputs, [BLOCK_H, BLOCK_S, BLOCK_D] float32 per program,
must stay small at these shapes (all heads of a 28-head model at once spill registers)."""

import pytest
import torch

from rollout.attention import cascade_decode_attention
from rollout.kernels import decode_attention, triton_cascade_decode_attention

from kernel_cases import cascade_metadata, random_pool

assert decode_attention.INTERPRETED, (
    "kernel tests need TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)"
)

GPU_BLOCK_N = 64
MERGE_TILE_MAX = 4 * 4 * 128  # float32 elements of partial output one merge program holds
SHAPES = [
    pytest.param(28, 4, 128, id="28q4kv-d128"),
    pytest.param(28, 4, 80, id="28q4kv-d80"),
    pytest.param(8, 8, 128, id="per_kv1-d128"),
    pytest.param(32, 4, 128, id="per_kv8-d128"),
]


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid and keyword arguments, then
    launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_decode_at_gpu_shapes_matches_reference(monkeypatch, num_heads, num_kv_heads, head_dim):
    page_size = 16
    g = torch.Generator().manual_seed(num_heads * 1000 + head_dim)
    # Group 0: a 2-page prefix, three members, one of them 3 queries (a verify pass); group 1:
    # no prefix, one member whose suffix spans ~1000 tokens, so the suffix phase is 64 pages
    # wide and, in chunks of 64 tokens, most chunks of the other members are empty.
    meta = cascade_metadata(
        [(2, [0, 13, 30]), (0, [1000])],
        page_size,
        80,
        g,
        num_queries=[[1, 3, 1], [1]],
    )
    k_cache, v_cache = random_pool(num_kv_heads, 80, page_size, head_dim, torch.float32, g)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g)
    spy = LaunchSpy(decode_attention._merge_kernel)
    monkeypatch.setattr(decode_attention, "_merge_kernel", spy)
    got = triton_cascade_decode_attention(
        q, k_cache, v_cache, meta, page_size, block_n=GPU_BLOCK_N, chunk_tokens=GPU_BLOCK_N
    )
    want = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
    assert (got - want).abs().max().item() <= 1e-5

    ((grid, blocks),) = spy.launches
    assert blocks["BLOCK_H"] * blocks["BLOCK_S"] * blocks["BLOCK_D"] <= MERGE_TILE_MAX, blocks
    assert grid[0] == meta.num_tokens and grid[1] * blocks["BLOCK_H"] >= num_heads


def test_split_plan_for_a_gpu(monkeypatch):
    """`plan_splits` with a GPU's 132 SMs: at most MAX_SPLITS_PER_PHASE splits, chunks of whole
    blocks, every token in exactly one chunk, and as many splits as allowed for one program per
    split on a context of many blocks."""
    monkeypatch.setattr(decode_attention, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for width in (16, 64, 1000, 4096, 32768, 131072):
        for programs in (1, 4, 28, 512):
            splits, chunk = decode_attention.plan_splits(width, programs, GPU_BLOCK_N, cuda)
            assert 1 <= splits <= decode_attention.MAX_SPLITS_PER_PHASE
            assert chunk % GPU_BLOCK_N == 0
            assert (splits - 1) * chunk < width <= splits * chunk
            if width >= 264 * GPU_BLOCK_N and programs == 1:
                assert splits == decode_attention.MAX_SPLITS_PER_PHASE
