"""TP=2, PP=2 and DP=2 over gloo in 2 CPU processes (torchrun), against HF and against TP=1.

Each layout runs `scenarios.run` (log-probs, export, one PPO step) for the same tiny checkpoints
and fixed batch as the single-process run in this pytest process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import scenarios
from trainer_helpers import FAMILIES, hf_response_logprobs, max_abs_diff

pytestmark = pytest.mark.slow


def _max_state_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_hf(layout, family, tiny_hf_checkpoints, parallel_results):
    hf_model, _ = tiny_hf_checkpoints(family)
    res = parallel_results[layout][family]
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    ref_lp, ref_ent = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(res["logprobs"], ref_lp) <= 1e-5
    assert max_abs_diff(res["entropy"], ref_ent) <= 1e-5


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips_bitwise(layout, family, hf_dirs, parallel_results):
    original = load_file(hf_dirs[family] / "model.safetensors")
    exported = parallel_results[layout][family]["exported"]
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_equals_single_process(layout, family, parallel_results, single_process_results):
    par, one = parallel_results[layout][family], single_process_results[family]
    assert _max_state_diff(par["after"], one["after"]) <= 1e-5
    assert par["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    assert par["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], abs=1e-6)


def test_data_parallel_step_equals_single_process(parallel_results, single_process_results):
    par = parallel_results["dp2"]["qwen2"]
    one = single_process_results["qwen2"]
    assert max_abs_diff(par["logprobs"], one["logprobs"]) <= 1e-5
    assert _max_state_diff(par["after"], one["after"]) <= 1e-5
    for key in ("loss", "pg_loss", "entropy", "ratio_mean", "ratio_max"):
        assert par["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-6), key


@pytest.mark.parametrize("layout", ["deepspeed-dp2", "zero3-dp2"])
def test_deepspeed_data_parallel_step_equals_megatron_single_process(
    layout, parallel_results, single_process_results
):
    """ZeRO-2 / ZeRO-3 over 2 gloo processes: same log-probs and the same optimizer step as the
    single-process megatron run (DeepSpeed averages over DP; our shares are scaled back)."""
    par = parallel_results[layout]["qwen3"]
    one = single_process_results["qwen3"]
    assert max_abs_diff(par["logprobs"], one["logprobs"]) <= 1e-5
    assert _max_state_diff(par["after"], one["after"]) <= 1e-5
    assert par["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], abs=1e-6)
    assert par["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
