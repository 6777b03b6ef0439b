"""The static-shape decode path (`rollout.decode_graphs`, captured as CUDA graphs on a GPU) computes
the same function as the dynamic path. On CPU it runs eagerly. Its greedy output is checked
against HF transformers in test_engine_vs_hf (variant "radix-page4-static-decode"); these tests
compare it with the engine's ordinary decode where HF has no counterpart (log-probs token by
token, preemption, the scratch page, release/resume):

* greedy tokens equal and logprobs within 1e-5, for every model family, with batch sizes that
  leave padding rows in their bucket;
* under a KV pool small enough to preempt, bookkeeping holds after every step and the scratch
  page that padding rows write to is never handed to a sequence;
* after `release_memory` / `resume_memory` (graphs must be dropped: the pool is re-allocated) it
  still matches.
"""

import itertools

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.decode_graphs import bucket_sizes


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
