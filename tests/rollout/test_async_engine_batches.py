"""`AsyncEngine.submit_many`: a batch submitted at once is admitted at once, so it is computed
exactly as `Engine.generate` computes it (same batches, so bitwise the same log-probs, and the
same prefix-cache hits between its prompts) whatever the step loop's timing. The controller's
batch `EngineWorker.generate` relies on it: a resumed run must repeat its metrics exactly."""

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import AsyncEngine

COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")
COMMON = [4, 8, 15, 16, 23, 42, 7, 7, 9]  # a shared prefix of two full pages and a bit
PROMPTS = [COMMON + [i, i + 1] for i in range(6)]
PARAMS = [
    SamplingParams(n=3, max_new_tokens=10, seed=100 + i, ignore_eos=True)
    for i in range(len(PROMPTS))
]


def _engine(directory) -> Engine:
    return Engine(EngineConfig(model_path=str(directory), kv_cache_tokens=4096, page_size=4))


def test_submit_many_computes_exactly_what_generate_computes(tiny_hf_checkpoints):
    directory = tiny_hf_checkpoints("qwen2")[1]
    ref = _engine(directory)
    expected = ref.generate(PROMPTS, PARAMS)
    want_stats = {k: ref.stats()[k] for k in COUNTERS}
    for _ in range(3):  # timing differs from run to run; the result may not
        engine = _engine(directory)
        async_engine = AsyncEngine(engine)
        try:
            futures = async_engine.submit_many(list(zip(PROMPTS, PARAMS)))
            got = [f.result(timeout=120).samples for f in futures]
        finally:
            async_engine.close()
        assert got == expected
        assert {k: engine.stats()[k] for k in COUNTERS} == want_stats
