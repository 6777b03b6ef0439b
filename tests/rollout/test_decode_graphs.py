"""The static-shape decode path (`rollout.decode_graphs`, captured as CUDA graphs on a GPU) computes
the same function as the dynamic path. On CPU it runs eagerly. Its greedy output is checked
against HF transformers in test_engine_vs_hf (variant "radix-page4-static-decode"); these tests
compare it with the engine's ordinary decode where HF has no counterpart (log-probs token by
token, preemption, the scratch page, release/resume):

* greedy tokens equal and logprobs within 1e-5, for every model family, with batch sizes that
  leave padding rows in their bucket;
* under a KV pool small enough to preempt, bookkeeping holds after every step and the scratch
  page that padding rows write to is never handed to a sequence;
* after `release_memory` / `resume_memory` it still matches;
* built buckets (captured graphs on CUDA) are kept across weight updates and KV-only releases
  (only a release of the weights re-builds them, counted in `graph_captures`).
"""

import itertools

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.decode_graphs import bucket_sizes
from rollout.weights import iter_safetensors


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 24, (count,), generator=g)
    ]


def assert_same_outputs(plain, static):
    for a, b in zip(itertools.chain(*plain), itertools.chain(*static)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_static_decode_equals_dynamic_decode(tiny_hf_checkpoints, family):
    model, directory = tiny_hf_checkpoints(family)
    vocab = model.config.vocab_size
    prompts = prompts_for(vocab, 5)
    params = SamplingParams(
        n=3, temperature=0.0, max_new_tokens=24, ignore_eos=True
    )  # 15 rows: bucket 16
    config = dict(model_path=str(directory), page_size=4, max_model_len=96)
    plain = Engine(EngineConfig(**config)).generate(prompts, params)
    engine = Engine(EngineConfig(**config, decode_graphs=True))
    static = engine.generate(prompts, params)
    assert engine.decode_graphs.replays >= 20
    assert_same_outputs(plain, static)
    engine.check_integrity()


def test_static_decode_under_preemption_keeps_the_scratch_page_private(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen2")
    prompts = prompts_for(97, 12, seed=1)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20, ignore_eos=True)
    plain = Engine(EngineConfig(model_path=str(directory), page_size=2, max_model_len=64)).generate(
        prompts, params
    )
    engine = Engine(
        EngineConfig(
            model_path=str(directory),
            page_size=2,
            max_model_len=64,
            kv_cache_tokens=120,
            max_running_requests=10,
            decode_graphs=True,
        )
    )
    scratch = engine.pool.scratch_page
    assert scratch == engine.pool.num_pages  # past every allocatable page
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.samples
        engine.check_integrity()
        held = {p for s in engine.scheduler.running for p in s.pages}
        assert scratch not in held and scratch not in engine.pool.free_page_ids()
    assert engine.stats()["preemptions"] > 0 and engine.decode_graphs.replays > 0
    assert_same_outputs(plain, [outputs[i] for i in ids])


def test_static_decode_after_release_and_resume(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen3")
    prompts = prompts_for(101, 3, seed=2)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, ignore_eos=True)
    engine = Engine(
        EngineConfig(model_path=str(directory), page_size=4, max_model_len=64, decode_graphs=True)
    )
    first = engine.generate(prompts, params)
    engine.release_memory()
    engine.resume_memory()
    assert engine.generate(prompts, params) == first


def test_bucket_sizes_cover_every_batch_with_little_padding():
    sizes = bucket_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    for batch in range(1, 257):
        bucket = next(b for b in sizes if b >= batch)
        assert bucket - batch < max(8, batch // 4)
    assert bucket_sizes(5) == [1, 2, 4, 5]


def test_static_buckets_survive_kv_release_and_weight_updates(tiny_hf_checkpoints):
    """Built buckets (on CUDA: captured graphs) are kept across a weight update (copied in place:
    no parameter moves) and a KV-only release / resume; releasing the weights drops them, and
    their re-building shows in `graph_captures`."""
    _, directory = tiny_hf_checkpoints("qwen3")
    prompts = prompts_for(101, 3, seed=2)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=10, ignore_eos=True)
    engine = Engine(
        EngineConfig(model_path=str(directory), page_size=4, max_model_len=64, decode_graphs=True)
    )
    first = engine.generate(prompts, params)
    built = engine.stats()["graph_captures"]
    buckets = dict(engine.decode_graphs._static)
    assert built == len(buckets) > 0
    addresses = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.update_weights(iter_safetensors(directory))
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == addresses
    engine.release_memory()
    engine.resume_memory()
    assert engine.generate(prompts, params) == first
    assert engine.stats()["graph_captures"] == built
    assert all(engine.decode_graphs._static[size] is b for size, b in buckets.items())
    engine.release_memory(weights=True)
    engine.resume_weights()
    engine.update_weights(iter_safetensors(directory))
    engine.alloc_kv()
    assert engine.generate(prompts, params) == first
    assert engine.stats()["graph_captures"] == 2 * built
