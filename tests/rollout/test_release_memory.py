"""`Engine.release_memory` really frees what it releases, and hands it back to the device.

* after `release_memory(weights=True)` no storage the engine held before it (found by walking
  the engine's objects: pool, parameters, fused projections, suffix lanes, decode-step buffers,
  the runner's and attention's cached plans) is still referenced by anything, except the three
  it keeps on purpose: the scheduler's slot table and the rotary tables (bookkeeping and
  constants sized by `max_model_len`, unchanged across a release, not part of a weight push);
* a KV-only release frees the pool and keeps every parameter;
* every release ends in the device allocator's release hook (`device_memory.return_freed`,
  called for real: the spy only counts), which on CUDA synchronizes and empties torch's cache.
"""

import pytest
import torch
from engine_storages import still_alive, storages_held, tensors_held

from rollout import Engine, EngineConfig, SamplingParams, device_memory

PROMPTS = [[5, 9, 2, 7, 11], [1, 2, 3]]
PARAMS = SamplingParams(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True)
VARIANTS = {
    "suffix-lanes": {},
    "static-decode": {"decode_graphs": True},
    "speculative": {"speculative_method": "ngram"},
}


@pytest.fixture
def release_calls(monkeypatch):
    """Devices `device_memory.return_freed` was called with (the real function still runs)."""
    calls: list[torch.device] = []
    real = device_memory.return_freed

    def counting(device):
        calls.append(device)
        real(device)

    monkeypatch.setattr(device_memory, "return_freed", counting)
    return calls


def _used_engine(directory, **config) -> Engine:
    engine = Engine(
        EngineConfig(model_path=str(directory), page_size=4, max_model_len=64, **config)
    )
    assert engine.generate(PROMPTS, PARAMS)
    return engine


def _kept_on_purpose(engine: Engine) -> set[str]:
    kept = (engine.scheduler.slot_table, engine.model.rotary.cos, engine.model.rotary.sin)
    return {path for path, t in tensors_held(engine).items() if any(t is k for k in kept)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_release_leaves_no_engine_storage_alive(tiny_hf_checkpoints, release_calls, variant):
    _, directory = tiny_hf_checkpoints("qwen2")
    engine = _used_engine(directory, **VARIANTS[variant])
    held = storages_held(engine)
    pool_paths = [p for p, t in tensors_held(engine).items() if t is engine.pool.k]
    assert pool_paths and all(p in held for p in pool_paths)
    assert sum(".model." in p or "embed" in p for p in held) > 10  # the weights were walked
    kept = _kept_on_purpose(engine)
    assert engine.release_memory(weights=True) > 0
    assert set(still_alive(held)) == kept & held.keys()
    assert release_calls == [engine.device]
    engine.resume_memory()


def test_kv_only_release_frees_the_pool_and_keeps_the_weights(tiny_hf_checkpoints, release_calls):
    _, directory = tiny_hf_checkpoints("qwen3")
    engine = _used_engine(directory)
    pool = storages_held(engine.pool)
    weights = storages_held(engine.model)
    engine.release_memory()
    assert still_alive(pool) == []
    assert still_alive(weights) == sorted(weights)
    assert release_calls == [engine.device]


def test_return_freed_empties_the_cuda_cache_after_the_queued_work(monkeypatch):
    """The CUDA branch, without a GPU: torch's two calls, in this order (synchronize first: a
    kernel still queued may read a block being returned); nothing on CPU."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    device_memory.return_freed(torch.device("cpu"))
    assert calls == []
    device_memory.return_freed(torch.device("cuda", 0))
    assert calls == ["sync", "empty_cache"]
