"""The Triton backend's cached decode plan does not outlive a release (Triton interpreter).

`TritonAttention` keeps the last step's decode plan (built from that step's metadata: on the
static decode path, the bucket's buffers). After the static-decode engine generated with it,
`DecodeGraphs.reset()` drops the plan, and `Engine.release_memory(weights=True)` leaves no storage
the engine held alive but the slot table and rotary tables (as with the torch backend,
tests/rollout/test_release_memory.py)."""

from engine_storages import still_alive, storages_held, tensors_held

from rollout import Engine, EngineConfig, SamplingParams
from rollout.kernels import TritonAttention
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint

CONFIG = {
    **TINY_QWEN2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 64,
}
PARAMS = SamplingParams(n=2, temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _static_engine_with_triton(tmp_path) -> tuple[Engine, TritonAttention]:
    directory = write_random_checkpoint(tmp_path / "ckpt", CONFIG, std=0.15)
    engine = Engine(
        EngineConfig(
            model_path=str(directory), kv_cache_tokens=128, page_size=4, decode_graphs=True
        )
    )
    # No config switch selects Triton on CPU; the attention object is the runner's (and the
    # static path's) seam.
    attention = TritonAttention(engine.pool, chunk_tokens=16)
    engine.runner.attention = engine.decode_graphs.attention = attention
    engine.generate([[5, 17, 3, 44, 9], [7, 70, 1]], PARAMS)
    assert engine.decode_graphs.replays > 0 and attention._plan is not None
    return engine, attention


def test_reset_drops_the_decode_plan(tmp_path):
    engine, attention = _static_engine_with_triton(tmp_path)
    plan = storages_held(attention._plan)
    assert plan
    engine.decode_graphs.reset()
    assert attention._plan is None and attention._plan_for is None
    assert still_alive(plan) == []


def test_release_leaves_no_plan_or_buffer_alive(tmp_path):
    engine, attention = _static_engine_with_triton(tmp_path)
    held = storages_held(engine)
    assert any("_plan" in path for path in held)
    kept = (engine.scheduler.slot_table, engine.model.rotary.cos, engine.model.rotary.sin)
    kept_paths = {p for p, t in tensors_held(engine).items() if any(t is k for k in kept)}
    engine.release_memory(weights=True)
    assert set(still_alive(held)) == kept_paths & held.keys()
