"""FP8 weights and an FP8 KV cache together (`quantization="fp8"`, `kv_cache_dtype="fp8_e4m3"`).

Reference: a float32 engine with an FP8 KV cache running the checkpoint's dequantized FP8
weights. The two features compose only if the KV calibration sees the weights the engine
computes with: the scales must then be equal (powers of two from the same amax within float32
rounding), and greedy tokens and log-probs equal within float32 rounding.
"""

from __future__ import annotations

import torch
from test_fp8_engine import GREEDY, PROMPTS, _checkpoint, _dequantized_copy

from rollout import Engine, EngineConfig


def test_fp8_weights_with_fp8_kv_cache_equal_dequantized_weights(tmp_path):
    checkpoint = _checkpoint(tmp_path, "qwen3")
    dequantized = _dequantized_copy(checkpoint, tmp_path / "dequantized", torch.float32)
    fp8 = Engine(
        EngineConfig(
            model_path=str(checkpoint),
            dtype="float32",
            quantization="fp8",
            kv_cache_dtype="fp8_e4m3",
        )
    )
    reference = Engine(
        EngineConfig(model_path=str(dequantized), dtype="float32", kv_cache_dtype="fp8_e4m3")
    )
    assert torch.equal(fp8.pool.k_scale, reference.pool.k_scale)
    assert torch.equal(fp8.pool.v_scale, reference.pool.v_scale)
    got = [s for r in fp8.generate(PROMPTS, GREEDY) for s in r]
    want = [s for r in reference.generate(PROMPTS, GREEDY) for s in r]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=2e-5, atol=1e-5
        )
