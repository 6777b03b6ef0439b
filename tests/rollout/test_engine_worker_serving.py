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


def test_worker_window_generate_one_lifecycle_and_endpoint(ray_local, model_dir):
    from miles_like.run.engine_worker import EngineWorker

    cfg = EngineConfig(
        model_path=str(model_dir), kv_cache_tokens=2048, page_size=4, max_model_len=128
    )
    params = [
        SamplingParams(n=2, max_new_tokens=8, seed=40 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    # the reference on the worker's thread count (1): float32 sums split over another number
    # of threads may round apart and flip a sampled token
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = Engine(cfg).generate(PROMPTS, params)
    finally:
        torch.set_num_threads(threads)
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
