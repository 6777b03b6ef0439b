"""The AsyncEngine's quota (over-sampling): once `quota` groups of a batch are complete, the
rest of the batch is aborted at the next engine step.

Reference: the same seeded requests run to the end by `Engine.generate`. With `ignore_eos` and
per-group `max_new_tokens` the completion order is known in advance (the shortest groups first),
the aborted samples are exact prefixes (tokens and log-probs) of the uninterrupted ones, all cut
at the same step, and a second run gives the same outcome (no timing in it).
"""

import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import AsyncEngine

PROMPTS = [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6], [3, 3, 3], [8, 1, 4, 1, 5], [2, 7, 1, 8], [6, 6]]
LENGTHS = [20, 6, 30, 9, 6, 25]  # groups 1 and 4 finish together, then group 3
GROUPS = [0, 1, 2, 3, 4, 5]


def _params(i: int) -> SamplingParams:
    return SamplingParams(n=2, max_new_tokens=LENGTHS[i], seed=100 + i, ignore_eos=True)


def _engine(directory) -> Engine:
    return Engine(EngineConfig(model_path=str(directory), kv_cache_tokens=4096, page_size=4))


@pytest.fixture
def qwen2(tiny_hf_checkpoints):
    return tiny_hf_checkpoints("qwen2")[1]


def _run(directory, quota: int):
    engine = AsyncEngine(_engine(directory))
    try:
        futures = engine.submit_many(
            [(p, _params(i)) for i, p in enumerate(PROMPTS)], groups=GROUPS, quota=quota
        )
        complete = AsyncEngine.complete_groups(futures).result(timeout=120)
        return complete, [f.result(timeout=120).samples for f in futures]
    finally:
        engine.close()


def test_quota_aborts_the_rest_at_one_step_as_prefixes_of_the_full_run(qwen2):
    full = _engine(qwen2).generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    complete, outs = _run(qwen2, quota=3)
    assert complete == [1, 4, 3]  # by completion step, ties by group id
    cut = set()
    for g, (samples, want) in enumerate(zip(outs, full)):
        for s, w in zip(samples, want):
            if g in complete:
                assert s.finish_reason == "length" and s.token_ids == w.token_ids
                assert s.logprobs == w.logprobs
            else:
                assert s.finish_reason == "abort"
                k = len(s.token_ids)
                assert 0 < k < LENGTHS[g]
                assert s.token_ids == w.token_ids[:k] and s.logprobs == w.logprobs[:k]
                cut.add(k)
    assert len(cut) == 1  # every unfinished sample stopped at the same step
    assert cut.pop() >= LENGTHS[3]
    again_complete, again = _run(qwen2, quota=3)
    assert again_complete == complete
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in outs]


def test_a_quota_never_reached_lets_everything_finish(qwen2):
    complete, outs = _run(qwen2, quota=len(PROMPTS) + 1)
    assert sorted(complete) == GROUPS
    assert all(s.finish_reason == "length" for g in outs for s in g)


def _run_prefilled(directory, quota: int):
    """The same batch prefilled on one `AsyncEngine` and decoded, with the quota, on another
    (prefill-decode: `submit_prefilled(groups=, quota=)`)."""
    prefiller, decoder = AsyncEngine(_engine(directory)), AsyncEngine(_engine(directory))
    try:
        requests = [(p, _params(i)) for i, p in enumerate(PROMPTS)]
        handoffs = [f.result(timeout=120) for f in prefiller.submit_prefill(requests)]
        futures = decoder.submit_prefilled(
            [(h, _params(i)) for i, h in enumerate(handoffs)], groups=GROUPS, quota=quota
        )
        complete = AsyncEngine.complete_groups(futures).result(timeout=120)
        return complete, [f.result(timeout=120).samples for f in futures]
    finally:
        prefiller.close()
        decoder.close()


@pytest.mark.parametrize("quota", [3, len(PROMPTS) + 1])
def test_a_quota_on_prefilled_requests_is_the_quota_on_one_engine(qwen2, quota):
    complete, outs = _run(qwen2, quota)
    pd_complete, pd_outs = _run_prefilled(qwen2, quota)
    assert pd_complete == complete
    for samples, want in zip(pd_outs, outs):
        assert [(s.token_ids, s.logprobs, s.finish_reason) for s in samples] == [
            (w.token_ids, w.logprobs, w.finish_reason) for w in want
        ]
