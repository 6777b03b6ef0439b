"""Randomised stress of the scheduler: many requests sharing prefixes, several samples each,
random aborts, and a KV pool small enough that eviction and preemption happen all the time.

* with and without the prefix cache (without it, a request's forks share its prompt's pages
  through a tree of their own);
* the page bookkeeping holds after every step (`check_integrity`: free + cached + in use ==
  total, lock refs, slot-table rows), and nothing leaks once all requests are done;
* preemption and eviction do not change results: every seeded sample that was not aborted
  equals the same request generated in an engine with a pool large enough to never preempt.
"""

import random

import pytest

from rollout import Engine, EngineConfig, SamplingParams


def _workload(rng: random.Random, vocab: int):
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    requests = []
    for i in range(40):
        prompt = rng.choice(systems) + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(
            n=rng.choice([1, 2, 4]),
            temperature=rng.choice([0.0, 0.8, 1.0]),
            top_k=rng.choice([-1, 5]),
            max_new_tokens=rng.randint(1, 24),
            seed=1000 + i,
            ignore_eos=True,
        )
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize(
    "page_size,prefix_cache", [(1, True), (4, True), (4, False)], ids=["p1", "p4", "p4-nocache"]
)
def test_random_workload_keeps_integrity_and_preemption_does_not_change_results(
    tiny_hf_checkpoints, page_size, prefix_cache
):
    _, directory = tiny_hf_checkpoints("qwen2")
    rng = random.Random(page_size)
    workload = _workload(rng, vocab=97)
    engine = Engine(
        EngineConfig(
            model_path=str(directory),
            kv_cache_tokens=96,
            page_size=page_size,
            max_running_requests=12,
            max_prefill_tokens=24,
            enable_prefix_cache=prefix_cache,
        )
    )
    pending = list(workload)
    ids: dict[int, int] = {}  # request id -> workload index
    aborted: set[int] = set()
    outputs = {}
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # requests keep arriving while others run
            if pending:
                prompt, params = pending.pop(0)
                ids[engine.add_request(prompt, params)] = len(workload) - len(pending) - 1
        if ids and rng.random() < 0.05:
            victim = rng.choice(list(ids))
            if victim not in outputs:
                engine.abort(victim)
                aborted.add(victim)
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_integrity()
        steps += 1
    stats = engine.stats()
    assert stats["preemptions"] > 0, stats
    assert (stats["evicted_tokens"] > 0) == prefix_cache, stats
    assert stats["running_sequences"] == 0 and stats["waiting_sequences"] == 0
    assert stats["kv_free_tokens"] + stats["prefix_cache_tokens"] == stats["kv_pool_tokens"]
    assert set(outputs) == set(ids)

    # Reference: every request alone... in one roomy engine (no preemption, no eviction).
    roomy = Engine(
        EngineConfig(model_path=str(directory), kv_cache_tokens=8192, page_size=page_size)
    )
    reference = roomy.generate([p for p, _ in workload], [sp for _, sp in workload])
    assert roomy.stats()["preemptions"] == 0
    compared = 0
    for request_id, index in ids.items():
        prompt, params = workload[index]
        got = outputs[request_id].samples
        assert len(got) == params.n
        for sample, ref in zip(got, reference[index]):
            if request_id in aborted and sample.finish_reason == "abort":
                assert sample.token_ids == ref.token_ids[: len(sample.token_ids)]
                continue
            assert sample.token_ids == ref.token_ids, (index, params)
            assert sample.finish_reason == ref.finish_reason == "length"
            assert len(sample.token_ids) == params.max_new_tokens
            compared += 1
    assert compared > 50
