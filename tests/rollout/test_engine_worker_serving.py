"""The EngineWorker Ray actor as a service: its rollout window, `generate_one` batched across
concurrent callers, lifecycle calls that close the window, and the HTTP endpoint it serves.

References: `Engine.generate` in this process on the same weights (seeded tokens), and the
official `openai` client for the endpoint."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
import ray

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import EngineUnavailable

from tiny_hf import make_hf_model, save_bpe_tokenizer, save_hf_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4], [7, 7, 1], [9, 8, 7, 6, 5]]


@pytest.fixture(scope="module")
def ray_local():
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
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
    from miles_like.workers import EngineWorker

    cfg = EngineConfig(
        model_path=str(model_dir), kv_cache_tokens=2048, page_size=4, max_model_len=128
    )
    params = [
        SamplingParams(n=2, max_new_tokens=8, seed=40 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    want = Engine(cfg).generate(PROMPTS, params)
    worker = EngineWorker.remote(cfg, 1)

    # closed at start: the batch generate still works (today's controller flow) ...
    outs, counters = ray.get(worker.generate.remote(PROMPTS, params), timeout=120)
    assert outs == want and counters["prefill_tokens_computed"] > 0
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
