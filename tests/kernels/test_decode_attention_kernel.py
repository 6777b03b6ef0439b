"""Split-K paged decode attention (plain and cascade) against the torch reference
`rollout.attention.cascade_decode_attention`, interpreted on CPU (see conftest.py).

Shapes are tiny (the interpreter runs numpy per block) but every structural case is there:
page sizes 1/4/16, GQA ratios 1 and 3, contexts cut into several split-K chunks, groups sharing
a prefix with several members, a group without prefix next to groups with one, several query
tokens per sequence (speculative verification) with causal suffix masks, and query tiles split
over several row blocks. Chunks are forced small (16 or 32 tokens, in 16-token blocks) so a
context of a few dozen tokens spans several programs."""

import pytest
import torch

from rollout.attention import cascade_decode_attention
from rollout.kernels import (
    decode_attention,
    triton_cascade_decode_attention,
    triton_paged_decode_attention,
)

from kernel_cases import cascade_metadata, plain_metadata, random_pool

assert decode_attention.INTERPRETED, (
    "kernel tests need TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)"
)

CHUNK = 16  # tokens per split-K program in the plain tests: one 16-token block each
CASCADE_CHUNK = 32  # in the cascade tests: two blocks per program, so the in-chunk rescaling runs
FP32_TOL = 1e-5
HEADS = [pytest.param(2, 2, 16, id="mha-d16"), pytest.param(6, 2, 32, id="gqa3-d32")]


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_paged_decode_matches_reference(page_size, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(page_size * 100 + num_heads)
    lengths = [1, 23, 50]  # 50 tokens = 4 chunks of 16
    pages_needed = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_needed) + 2
    k_cache, v_cache = random_pool(num_kv_heads, num_pages, page_size, head_dim, torch.float32, g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    rows = [[perm.pop() for _ in range(n)] for n in pages_needed]
    width = max(pages_needed)
    page_table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g)

    splits, _ = decode_attention.plan_splits(width * page_size, 1, 16, q.device, CHUNK)
    assert splits >= 4, "the scene must exercise the split-K merge"
    got = triton_paged_decode_attention(
        q, k_cache, v_cache, page_table, torch.tensor(lengths), page_size, chunk_tokens=CHUNK
    )
    want = cascade_decode_attention(
        q, k_cache, v_cache, plain_metadata(page_table, lengths, page_size), page_size
    )
    assert max_err(got, want) <= FP32_TOL


def test_merge_over_more_splits_than_one_merge_block():
    """A 144-token group prefix in chunks of 16 = 9 prefix splits > MERGE_BLOCK_S, so the merge's
    online loop runs twice; for the lone sequence (empty prefix) its first pass sees only empty
    splits (lse = -inf everywhere)."""
    g = torch.Generator().manual_seed(2)
    page_size = 16
    k_cache, v_cache = random_pool(2, 16, page_size, 16, torch.float32, g)
    meta = cascade_metadata([(9, [5, 20]), (0, [7])], page_size, 16, g)
    # Larger suffix keys make the suffix split's lse the largest, merged last: the running max
    # rises in the second pass and the earlier passes' sums must be rescaled.
    suffix_slots = (
        meta.suffix_pages.unique().unsqueeze(-1) * page_size + torch.arange(page_size)
    ).reshape(-1)
    k_cache[:, suffix_slots] *= 4
    q = torch.randn(meta.num_tokens, 6, 16, generator=g)
    splits, _ = decode_attention.plan_splits(9 * page_size, 1, 16, q.device, CHUNK)
    assert splits > decode_attention.MERGE_BLOCK_S
    got = triton_cascade_decode_attention(q, k_cache, v_cache, meta, page_size, chunk_tokens=CHUNK)
    assert max_err(got, cascade_decode_attention(q, k_cache, v_cache, meta, page_size)) <= FP32_TOL


# groups: (prefix pages, [suffix tokens already computed, per member]); queries per member
SCENE = [(2, [0, 13, 30]), (1, [4]), (0, [40]), (3, [2, 7])]
SCENE_QUERIES = [[1, 3, 1], [1], [2], [1, 4]]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_cascade_decode_matches_reference(page_size, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(page_size * 10 + num_heads)
    scene = [
        (max(1, p * 8 // page_size) if p else 0, members) for p, members in SCENE
    ]  # 8..24-token prefixes
    num_pages = max(96, 320 // page_size)
    k_cache, v_cache = random_pool(num_kv_heads, num_pages, page_size, head_dim, torch.float32, g)
    meta = cascade_metadata(scene, page_size, num_pages, g, num_queries=SCENE_QUERIES)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g)
    got = triton_cascade_decode_attention(
        q, k_cache, v_cache, meta, page_size, chunk_tokens=CASCADE_CHUNK
    )
    want = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
    assert max_err(got, want) <= FP32_TOL


def test_cascade_single_query_per_sequence():
    """The common decode step: one query per sequence, GRPO-like groups of equal members."""
    g = torch.Generator().manual_seed(3)
    page_size = 4
    k_cache, v_cache = random_pool(2, 64, page_size, 16, torch.float32, g)
    meta = cascade_metadata([(5, [3, 9, 1, 17]), (2, [6, 6, 6, 6])], page_size, 64, g)
    q = torch.randn(meta.num_tokens, 6, 16, generator=g)
    got = triton_cascade_decode_attention(
        q, k_cache, v_cache, meta, page_size, chunk_tokens=CASCADE_CHUNK
    )
    assert max_err(got, cascade_decode_attention(q, k_cache, v_cache, meta, page_size)) <= FP32_TOL


def test_cascade_query_rows_over_several_row_blocks():
    """members x queries x heads per KV head = 6 x 4 x 3 = 72 rows > 64: two row tiles per
    context."""
    g = torch.Generator().manual_seed(4)
    page_size = 4
    k_cache, v_cache = random_pool(1, 64, page_size, 16, torch.float32, g)
    members = [1, 5, 9, 2, 0, 3]
    meta = cascade_metadata([(4, members)], page_size, 64, g, num_queries=[[4, 1, 2, 4, 3, 4]])
    q = torch.randn(meta.num_tokens, 3, 16, generator=g)
    got = triton_cascade_decode_attention(
        q, k_cache, v_cache, meta, page_size, chunk_tokens=CASCADE_CHUNK
    )
    assert max_err(got, cascade_decode_attention(q, k_cache, v_cache, meta, page_size)) <= FP32_TOL


def test_cascade_honours_any_bias():
    """The kernel adds the bias it is given, so masked holes inside a context count as in the
    reference, not only a padded tail; a block masked whole for a row leaves it at -inf
    without NaNs."""
    g = torch.Generator().manual_seed(5)
    page_size = 4
    k_cache, v_cache = random_pool(2, 64, page_size, 16, torch.float32, g)
    meta = cascade_metadata([(3, [10, 20]), (0, [12])], page_size, 64, g, num_queries=[[2, 1], [1]])
    meta.prefix_bias[0, 2:5] = float("-inf")
    meta.suffix_bias[1, :, 0:16] = float("-inf")  # a whole 16-token block masked for these rows
    meta.suffix_bias[1, :, 18:19] = float("-inf")
    meta.suffix_bias[0, 0, 0] = -1.5  # a finite additive term, too
    q = torch.randn(meta.num_tokens, 4, 16, generator=g)
    got = triton_cascade_decode_attention(
        q, k_cache, v_cache, meta, page_size, chunk_tokens=CASCADE_CHUNK
    )
    assert max_err(got, cascade_decode_attention(q, k_cache, v_cache, meta, page_size)) <= FP32_TOL


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_cascade_decode_16bit(dtype, tol):
    """16-bit pool: float16 runs the native-dot path of the GPU (probabilities rounded to the
    pool dtype before the PV dot); bfloat16 runs with float32 dots, as the interpreter cannot
    multiply bfloat16. Both agree with the reference to a few units of the output dtype's
    rounding (bf16: 2^-8 relative, fp16: 2^-11)."""
    g = torch.Generator().manual_seed(6)
    page_size = 4
    k_cache, v_cache = random_pool(2, 96, page_size, 32, dtype, g)
    meta = cascade_metadata(
        [(3, [1, 20, 35]), (0, [44])], page_size, 96, g, num_queries=[[1, 2, 1], [3]]
    )
    q = torch.randn(meta.num_tokens, 6, 32, generator=g).to(dtype)
    got = triton_cascade_decode_attention(
        q, k_cache, v_cache, meta, page_size, chunk_tokens=CASCADE_CHUNK
    )
    want = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
    assert got.dtype == dtype
    assert max_err(got, want) <= tol
