"""`TritonAttention.forward` against `TorchAttention.forward` on one mixed engine step: decode
tokens of a cascade batch (one with drafts) followed by a prefill chunk, into layer 1 of a
two-layer pool (interpreted on CPU, see conftest.py)."""

import pytest
import torch

from rollout.attention import AttentionMetadata, PrefillSegment, TorchAttention
from rollout.kernels import TritonAttention, decode_attention
from rollout.kv_pool import KVPool

from kernel_cases import cascade_metadata

assert decode_attention.INTERPRETED, (
    "kernel tests need TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)"
)


def decode_token_slots(meta, page_size: int) -> torch.Tensor:
    """Slot of each decode token: the last suffix position its (causal) mask shows it."""
    num_queries = meta.suffix_bias.shape[1]
    seq, query = meta.token_cell // num_queries, meta.token_cell % num_queries
    visible = meta.suffix_bias[seq, query] != float("-inf")  # [T, W]
    position = (visible * torch.arange(1, visible.shape[1] + 1)).amax(-1) - 1
    return meta.suffix_pages[seq, position // page_size] * page_size + position % page_size


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_triton_backend_matches_torch_backend(dtype, tol):
    g = torch.Generator().manual_seed(7)
    page_size, num_kv_heads, num_heads, head_dim = 4, 2, 6, 16
    decode_pages, prefill_pages = 48, 8
    pools = [
        KVPool(
            num_layers=2,
            num_pages=decode_pages + prefill_pages,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        for _ in range(2)
    ]
    init_k = torch.randn(pools[0].k.shape, generator=g).to(dtype)
    init_v = torch.randn(pools[0].v.shape, generator=g).to(dtype)
    for pool in pools:
        pool.k.copy_(init_k)
        pool.v.copy_(init_v)

    # Decode: pages [0, 48). Prefill: a chunk of 5 new tokens after 6 cached ones, pages [48, 56).
    meta_decode = cascade_metadata(
        [(2, [3, 11]), (0, [6])], page_size, decode_pages, g, num_queries=[[1, 3], [1]]
    )
    context = torch.arange(decode_pages * page_size, decode_pages * page_size + 11)
    segment = PrefillSegment(meta_decode.num_tokens, 5, context, prefix_len=6)
    out_slots = torch.cat([decode_token_slots(meta_decode, page_size), context[6:]])
    meta = AttentionMetadata(out_slots, meta_decode, (segment,))

    num_tokens = out_slots.shape[0]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    want = TorchAttention(pools[0]).forward(1, q, k, v, meta)
    got = TritonAttention(pools[1], chunk_tokens=16).forward(1, q, k, v, meta)

    assert torch.equal(pools[1].k, pools[0].k) and torch.equal(pools[1].v, pools[0].v)
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_engine_generates_the_same_with_the_triton_backend(tmp_path):
    """End to end on a tiny random Qwen2-layout checkpoint (GQA 3, head_dim 16): GRPO-shaped
    requests (n samples sharing a prompt, so decode runs the cascade with group prefixes, page
    size 4) give the same tokens and logprobs with TritonAttention swapped in as with the
    reference backend."""
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.kernels import TritonAttention
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
                device="cpu",
                dtype="float32",
                kv_cache_tokens=256,
                page_size=4,
            )
        )
        if backend == "triton":
            # No config switch selects it on CPU; the attention object is the runner's seam.
            engine.runner.attention = TritonAttention(engine.pool, chunk_tokens=16)
        results.append(engine.generate(prompts, params))
    want, got = results
    for want_prompt, got_prompt in zip(want, got):
        for w, g in zip(want_prompt, got_prompt):
            assert list(g.token_ids) == list(w.token_ids)
            torch.testing.assert_close(
                torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0
            )
