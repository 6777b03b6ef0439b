"""The EngineWorker Ray actor as a service: its rollout window, `generate_one` batched across
concurrent callers, lifecycle calls that close the window, and the HTTP endpoint it serves.

References: `Engine.generate` in this process on the same weights (seeded tokens), and the
official `openai` client for the endpoint."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest
import ray
import shared_ray
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import EngineUnavailable
from rollout.sequence import SampleOutput

from tiny_hf import make_hf_model, save_bpe_tokenizer, save_hf_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4], [7, 7, 1], [9, 8, 7, 6, 5]]


@pytest.fixture(scope="module")
def ray_local():
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    shared_ray.stop()  # the controller modules' local Ray, if one is left running
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("worker_model")
    tokenizer = save_bpe_tokenizer(directory, ["one two three four five six"] * 20, vocab_size=280)
    save_hf_model(make_hf_model("qwen2", vocab_size=len(tokenizer)), directory)
    return directory


def _config_and_reference(model_dir, first_seed: int):
    """The workers' engine config, one seeded request per prompt (n = 2), and what one engine
    samples for them on the workers' thread count (1: float32 sums split over another number of
    threads may round apart and flip a sampled token)."""
    cfg = EngineConfig(
        model_path=str(model_dir), kv_cache_tokens=2048, page_size=4, max_model_len=128
    )
    params = [
        SamplingParams(n=2, max_new_tokens=8, seed=first_seed + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cfg, params, Engine(cfg).generate(PROMPTS, params)
    finally:
        torch.set_num_threads(threads)


def test_worker_window_generate_one_lifecycle_and_endpoint(ray_local, model_dir):
    from miles_like.run.engine_worker import EngineWorker

    cfg, params, want = _config_and_reference(model_dir, 40)
    worker = EngineWorker.remote(cfg, 1)

    # closed at start: the batch generate still works (today's controller flow) ...
    outs, counters = ray.get(worker.generate.remote(PROMPTS, params), timeout=120)
    # each sample as the engine's, with no routes (a dense model; not asked for either)
    assert [[SampleOutput(*s[:4]) for s in o] for o in outs] == want
    assert all(s.routes is None for o in outs for s in o)
    assert counters["prefill_tokens_computed"] > 0
    assert not ray.get(worker.is_open.remote())
    # ... while generate_one is refused until the window opens
    with pytest.raises(EngineUnavailable):
        ray.get(worker.generate_one.remote(PROMPTS[0], params[0]), timeout=60)

    ray.get(worker.open.remote())
    before = ray.get(worker.stats.remote())
    refs = [worker.generate_one.remote(PROMPTS[i % 3], params[i % 3]) for i in range(12)]
    results = ray.get(refs, timeout=120)
    after = ray.get(worker.stats.remote())
    for i, r in enumerate(results):
        assert [s.token_ids for s in r.samples] == [s.token_ids for s in want[i % 3]]
        assert r.weight_version == 0
    generated = after["generated_tokens"] - before["generated_tokens"]
    assert generated == 12 * 2 * 8
    assert after["decode_steps"] - before["decode_steps"] < generated / 4  # batched together

    url = ray.get(worker.serve.remote())
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(
        model=model_dir.name,
        prompt=PROMPTS[1],
        max_tokens=8,
        seed=41,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.token_ids for c in out.choices] == [s.token_ids for s in want[1]]

    # a lifecycle call closes the window itself: the endpoint answers 503 until open()
    ray.get(worker.flush_prefix_cache.remote(), timeout=60)
    assert not ray.get(worker.is_open.remote())
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model_dir.name, prompt=PROMPTS[1], max_tokens=2)
    assert info.value.status_code == 503
    ray.get(worker.set_weight_version.remote(3))
    ray.get(worker.open.remote())
    again = client.completions.create(
        model=model_dir.name,
        prompt=PROMPTS[1],
        max_tokens=8,
        seed=41,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert again.weight_version == 3
    assert [c.token_ids for c in again.choices] == [s.token_ids for s in want[1]]
    ray.get(worker.shutdown.remote(), timeout=60)
    ray.kill(worker)


LONG_TOKENS = 480


def test_cancel_wave_aborts_one_request_and_parks_its_kv(ray_local, model_dir):
    """`generate_wave` + `cancel_wave` (the fully async producer's staleness check under
    `rollout.partial: in_place`): the cancelled request comes back unfinished with its tokens,
    log-probs and per-token versions, the other runs to its end; with `park_kv` the cancelled
    sample's K/V is parked and its continuation (prompt + tokens) adopts it."""
    from miles_like.run.engine_worker import EngineWorker

    # long enough that the cancel lands while request 0 runs
    cfg = EngineConfig(
        model_path=str(model_dir), kv_cache_tokens=2048, page_size=4, max_model_len=512
    )
    worker = EngineWorker.remote(cfg, 1)
    ray.get(worker.open.remote())
    long = SamplingParams(n=1, max_new_tokens=LONG_TOKENS, seed=3, ignore_eos=True, park_kv=True)
    stream = worker.generate_wave.remote([PROMPTS[0], PROMPTS[2]], [long, long], 7)
    deadline = time.monotonic() + 60
    while ray.get(worker.stats.remote())["generated_tokens"] < 4:
        assert time.monotonic() < deadline, "the wave did not start"
        time.sleep(0.01)
    ray.get(worker.cancel_wave.remote(7, [0]), timeout=60)
    items = {}
    for ref in stream:
        k, samples, version, versions = ray.get(ref, timeout=120)
        items[k] = (samples, versions)
    (cut,), (cut_versions,) = items[0]
    (full,), _ = items[1]
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < LONG_TOKENS
    assert len(cut.logprobs) == len(cut_versions) == len(cut.token_ids)
    assert full.finish_reason == "length" and len(full.token_ids) == LONG_TOKENS
    parked = ray.get(worker.stats.remote())["parked_kv_tokens"]
    assert parked > 0
    ray.get(worker.cancel_wave.remote(7, [0, 1]), timeout=60)  # the wave is over: nothing
    rest = SamplingParams(
        n=1, max_new_tokens=LONG_TOKENS - len(cut.token_ids), seed=4, ignore_eos=True, park_kv=True
    )
    before = ray.get(worker.stats.remote())["parked_reused_tokens"]
    (ref,) = list(worker.generate_wave.remote([PROMPTS[0] + list(cut.token_ids)], [rest], 8))
    _, (more,), _, _ = ray.get(ref, timeout=120)
    assert len(more.token_ids) == LONG_TOKENS - len(cut.token_ids)
    reused = ray.get(worker.stats.remote())["parked_reused_tokens"] - before
    assert reused == parked  # the continuation computed only its pending token
    ray.kill(worker)


def test_decode_wave_serves_handoffs_as_one_engine_and_refuses_stale_ones(ray_local, model_dir):
    """`decode_wave` (the fully async producer's wave on a decode replica): a prefill replica's
    handoffs and a request computed on the decode replica itself (`direct`) come back as one
    engine samples them (`Engine.generate`, same seeds: the same tokens); a handoff prefilled
    at another weight version is refused, not decoded (counted, nothing yielded for it); with
    the window closed the wave yields CLOSED alone."""
    from miles_like.run.engine_worker import CLOSED, EngineWorker

    cfg, params, want = _config_and_reference(model_dir, 60)
    prefiller, decoder = EngineWorker.remote(cfg, 1), EngineWorker.remote(cfg, 1)
    ray.get([prefiller.open.remote(), decoder.open.remote()], timeout=120)

    def wave(handoffs: list, wave_params: list, direct: dict, wave_id: int) -> list:
        return [
            ray.get(ref, timeout=120)
            for ref in decoder.decode_wave.remote(handoffs, wave_params, direct, wave_id)
        ]

    # requests 0 and 2 prefilled on the prefill replica, request 1 computed on the decode one
    counters_ref, handoffs_ref = prefiller.prefill.remote(
        [PROMPTS[0], PROMPTS[2]], [params[0], params[2]], True
    )
    counters = ray.get(counters_ref, timeout=120)
    items = wave([handoffs_ref], params, {1: PROMPTS[1]}, 1)
    ray.get(prefiller.release_handoffs.remote(counters["handoff_key"]), timeout=60)
    *served, last = items
    assert sorted(k for k, *_ in served) == [0, 1, 2]
    for k, samples, version, versions in served:
        # the same tokens; float32 log-probs within the prefill-decode tests' tolerance (the
        # prompt was computed in another batch than the reference's)
        for got, ref in zip(samples, want[k], strict=True):
            assert (got.token_ids, got.finish_reason) == (ref.token_ids, ref.finish_reason)
            assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) <= 1e-5
        assert version == 0 and all(v == [0] * 8 for v in versions)
    assert last["pd_requests"] == 2 and last["pd_transfer_bytes"] > 0
    assert last["refused"] == 0

    # the decode replica moved to version 1: a handoff of version 0 is refused
    counters_ref, handoffs_ref = prefiller.prefill.remote([PROMPTS[0]], [params[0]], True)
    key = ray.get(counters_ref, timeout=120)["handoff_key"]
    ray.get(decoder.set_weight_version.remote(1), timeout=60)  # closes the window
    assert wave([handoffs_ref], [params[0]], {}, 2) == [CLOSED]
    ray.get(decoder.open.remote(), timeout=60)
    (last,) = wave([handoffs_ref], [params[0]], {}, 3)
    assert last["refused"] == 1
    ray.get(prefiller.release_handoffs.remote(key), timeout=60)
    ray.kill(prefiller)
    ray.kill(decoder)


def test_prefill_waves_send_a_refused_wave_again(ray_local, model_dir):
    """The fully async producer's prefill-decode waves (`async_producer.disaggregated.
    PrefillWaves`: `send` prefills a fill's waves, `decode` streams each) on a real prefill and
    decode replica: a wave prefilled at a weight version
    its decode replica is not at is refused whole (nothing delivered, the wave to be sent
    again: `retry`); sent again once both are at one version, it is served as one engine
    samples it, and both transfers are counted."""
    import asyncio

    from miles_like.rollouts.async_producer.replacement import Replicas
    from miles_like.run.engine_worker import EngineWorker

    cfg = EngineConfig(
        model_path=str(model_dir), kv_cache_tokens=2048, page_size=4, max_model_len=128
    )
    params = [SamplingParams(n=2, max_new_tokens=6, seed=80 + i, ignore_eos=True) for i in (0, 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count (see the first test)
    try:
        want = Engine(cfg).generate(PROMPTS[:2], params)
    finally:
        torch.set_num_threads(threads)
    prefiller, decoder = EngineWorker.remote(cfg, 1), EngineWorker.remote(cfg, 1)
    ray.get(prefiller.set_weight_version.remote(1), timeout=120)  # an update the decoder lacks
    ray.get([prefiller.open.remote(), decoder.open.remote()], timeout=120)

    async def unused(*_):
        raise AssertionError("nothing is replaced here")

    replicas = Replicas([prefiller, decoder], 120, False, unused, lambda: None, prefill_replicas=1)
    assert replicas.decoding == range(1, 2)

    def wave(wave_id: int) -> tuple:
        got, outcome = [], {}

        async def run_wave(j: int, handoffs) -> None:
            assert j == 0 and isinstance(handoffs, list) and len(handoffs) == 1
            outcome["decoded"] = await replicas.prefill.decode(
                1, handoffs, params, {}, wave_id, got.append
            )

        asyncio.run(replicas.prefill.send([(1, PROMPTS[:2], params, set())], run_wave))
        failure, retry = outcome["decoded"]
        assert failure is None
        return got, retry

    assert wave(1) == ([], True)
    ray.get(decoder.set_weight_version.remote(1), timeout=60)
    ray.get(decoder.open.remote(), timeout=60)
    got, retry = wave(2)
    assert not retry and sorted(k for k, *_ in got) == [0, 1]
    for k, samples, version, _ in got:
        assert [s.token_ids for s in samples] == [s.token_ids for s in want[k]]
        assert version == 1
    transfers = replicas.prefill.take_transfers()
    assert transfers["pd_requests"] == 4 and transfers["pd_transfer_bytes"] > 0
    assert ray.get(prefiller.stats.remote(), timeout=60)["prefill_calls"] == 2
    assert not replicas.dead
    ray.kill(prefiller)
    ray.kill(decoder)
