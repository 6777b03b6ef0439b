"""The AsyncEngine: one step loop for many callers.

* seeded requests submitted concurrently (threads and asyncio) give exactly `Engine.generate`'s
  tokens and logprobs, and are batched (decode steps far fewer than generated tokens);
* a request's own error reaches its future as the same exception; the loop keeps serving;
* pause: submissions raise EngineUnavailable, in-flight requests finish (or are aborted), nothing
  steps while paused, a weight update in the window is seen by every later request only;
* `cached_tokens` counts the prompt tokens a request took from the prefix cache;
* a stop check ends a sample with "stop", keeping the token that completed it;
* `held_open` serves a closed window for its block only (an open one stays open), also when the
  block raises.
"""

import asyncio
import threading
import time

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import AsyncEngine, EngineUnavailable, held_open
from rollout.weights import iter_safetensors

PROMPTS = [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 3], [8, 1, 4, 1, 5, 9, 2, 6]]
PARAMS = [
    SamplingParams(n=2, max_new_tokens=12, seed=11 + i, ignore_eos=True)
    for i in range(len(PROMPTS))
]


def _engine(directory, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(directory), kv_cache_tokens=4096, page_size=4, **kw))


@pytest.fixture
def qwen2(tiny_hf_checkpoints):
    return tiny_hf_checkpoints("qwen2")[1]


def test_concurrent_seeded_requests_equal_generate_and_are_batched(qwen2):
    expected = _engine(qwen2).generate(PROMPTS, PARAMS)
    async_engine = AsyncEngine(_engine(qwen2))
    try:
        results: dict[int, object] = {}

        def client(i):
            results[i] = async_engine.submit(PROMPTS[i], PARAMS[i]).result(timeout=60)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()

        async def many():
            return await asyncio.gather(
                *(async_engine.generate(PROMPTS[i], PARAMS[i]) for i in range(2, 4))
            )

        results.update(enumerate(asyncio.run(many()), start=2))
        for t in threads:
            t.join()
        for i, want in enumerate(expected):
            # Tokens exactly; logprobs up to float32 rounding (another batch, other GEMM shapes).
            assert [s.token_ids for s in results[i].samples] == [s.token_ids for s in want]
            for got, ref in zip(results[i].samples, want):
                assert got.finish_reason == ref.finish_reason
                torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
            assert results[i].prompt_token_ids == PROMPTS[i]
            assert results[i].weight_version == 0
        stats = async_engine.stats()
        assert stats["generated_tokens"] == sum(len(s.token_ids) for w in expected for s in w)
        assert stats["decode_steps"] < stats["generated_tokens"] / 3  # 8 samples decode together
    finally:
        async_engine.close()


def test_request_errors_reach_their_future_and_loop_keeps_serving(qwen2):
    async_engine = AsyncEngine(_engine(qwen2))
    try:
        too_long = async_engine.submit([1] * 500, SamplingParams(max_new_tokens=100))
        with pytest.raises(ValueError, match="max_model_len"):
            too_long.result(timeout=30)
        with pytest.raises(ValueError, match="vocabulary"):
            asyncio.run(async_engine.generate([10_000], SamplingParams()))
        ok = async_engine.submit(PROMPTS[0], PARAMS[0]).result(timeout=60)
        assert len(ok.samples) == 2
    finally:
        async_engine.close()


def test_step_failure_fails_every_in_flight_future(qwen2):
    engine = _engine(qwen2)
    async_engine = AsyncEngine(engine, open=False)
    real_run = engine.runner.run
    engine.runner.run = lambda batch: (_ for _ in ()).throw(RuntimeError("device lost"))
    async_engine.resume()
    futures = [async_engine.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    for f in futures:
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(timeout=30)
    engine.runner.run = real_run  # the engine was cleaned up: it serves again
    assert len(async_engine.submit(PROMPTS[0], PARAMS[0]).result(timeout=60).samples) == 2
    async_engine.close()


def test_pause_waits_then_blocks_and_resume_serves_new_weights(qwen2):
    engine = _engine(qwen2)
    async_engine = AsyncEngine(engine)
    try:
        long = SamplingParams(max_new_tokens=60, seed=1, ignore_eos=True)
        running = async_engine.submit(PROMPTS[1], long)
        time.sleep(0.05)
        async_engine.pause()
        assert running.done() and len(running.result().samples[0].token_ids) == 60
        with pytest.raises(EngineUnavailable, match="updating weights"):
            async_engine.submit(PROMPTS[0], PARAMS[0])
        steps = engine.stats()["decode_steps"]
        engine.update_weights((n, t * 1.5) for n, t in iter_safetensors(qwen2))
        time.sleep(0.05)
        assert engine.stats()["decode_steps"] == steps  # nothing stepped while paused
        async_engine.resume()
        after = async_engine.submit(PROMPTS[1], long).result(timeout=60)
        assert after.weight_version == 1
        fresh = _engine(qwen2)
        fresh.update_weights((n, t * 1.5) for n, t in iter_safetensors(qwen2))
        assert after.samples == fresh.generate([PROMPTS[1]], long)[0]
    finally:
        async_engine.close()


def test_pause_with_abort_ends_running_requests(qwen2):
    async_engine = AsyncEngine(_engine(qwen2))
    try:
        future = async_engine.submit(
            PROMPTS[0], SamplingParams(max_new_tokens=400, ignore_eos=True)
        )
        time.sleep(0.2)
        async_engine.pause(abort_running=True)
        sample = future.result(timeout=0).samples[0]
        assert sample.finish_reason == "abort" and len(sample.token_ids) < 400
        async_engine.resume()
        assert async_engine.submit(PROMPTS[0], PARAMS[0]).result(timeout=60).samples
    finally:
        async_engine.close()
    with pytest.raises(EngineUnavailable, match="closed"):
        async_engine.submit(PROMPTS[0], PARAMS[0])


def test_cancelled_await_aborts_the_request_in_the_engine(qwen2):
    engine = _engine(qwen2)
    async_engine = AsyncEngine(engine)
    try:
        long = SamplingParams(max_new_tokens=400, ignore_eos=True)

        async def impatient():
            await asyncio.wait_for(async_engine.generate(PROMPTS[0], long), timeout=0.2)

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(impatient())
        async_engine.pause()  # returns once the aborted request has left the engine
        assert not engine.has_unfinished()
        assert engine.stats()["generated_tokens"] < 400
    finally:
        async_engine.close()


def test_cached_tokens_counts_the_reused_prefix(qwen2):
    async_engine = AsyncEngine(_engine(qwen2))  # page_size 4
    try:
        base = list(range(1, 22))  # 21 tokens
        first = async_engine.submit(base, SamplingParams(max_new_tokens=3)).result(timeout=60)
        assert first.cached_tokens == 0
        turn2 = base + first.samples[0].token_ids + [7, 7]
        second = async_engine.submit(turn2, SamplingParams(max_new_tokens=3)).result(timeout=60)
        # cached: the whole pages of the first request's computed tokens (21 + 3 - 1 = 23)
        assert second.cached_tokens == 20
    finally:
        async_engine.close()


def test_stop_check_ends_sample_with_stop_keeping_the_token(qwen2):
    params = SamplingParams(max_new_tokens=20, seed=5, ignore_eos=True)
    reference = _engine(qwen2).generate([PROMPTS[2]], params)[0][0].token_ids
    async_engine = AsyncEngine(_engine(qwen2))
    try:
        stop_at = reference[6]
        index = reference.index(stop_at)
        out = async_engine.submit(
            PROMPTS[2], params, stop_check=lambda ids: ids[-1] == stop_at
        ).result(timeout=60)
        sample = out.samples[0]
        assert sample.finish_reason == "stop"
        assert sample.token_ids == reference[: index + 1]
    finally:
        async_engine.close()


def test_stop_check_inside_accepted_speculative_drafts(qwen2):
    """The check runs per token, also on tokens accepted several at a time: the target is its
    own draft model, so greedy drafts are always accepted whole and most stops fall inside one."""
    prompt = [4, 5, 6, 7] * 3
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    reference = _engine(qwen2).generate([prompt], greedy)[0][0].token_ids
    engine = _engine(qwen2, speculative_method="draft", speculative_draft_model_path=str(qwen2))
    async_engine = AsyncEngine(engine)
    try:
        for k in range(2, 12):
            result = async_engine.submit(
                prompt, greedy, stop_check=lambda ids, k=k: len(ids) == k
            ).result(60)
            assert result.samples[0].token_ids == reference[:k]
            assert result.samples[0].finish_reason == "stop"
        stats = engine.stats()
        assert stats["spec_accepted_tokens"] >= stats["generated_tokens"] / 2
    finally:
        async_engine.close()


def test_held_open_restores_the_window_it_found(qwen2):
    async_engine = AsyncEngine(_engine(qwen2), open=False)
    with held_open(async_engine):
        out = async_engine.submit(PROMPTS[0], PARAMS[0]).result(timeout=60)
        assert len(out.samples) == 2
    assert not async_engine.is_open
    with pytest.raises(EngineUnavailable):
        async_engine.submit(PROMPTS[0], PARAMS[0])
    with pytest.raises(KeyError), held_open(async_engine):
        raise KeyError("the block failed")
    assert not async_engine.is_open
    async_engine.resume()
    with held_open(async_engine):
        pass
    assert async_engine.is_open  # it was open: left open
    async_engine.close()
