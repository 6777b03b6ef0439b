"""megatron's DistributedOptimizer (optimizer state sharded over DP) against the optimizer held
whole on every rank, over gloo with DP = 2 (review row B6).

The whole-state optimizer is the reference (test_optimizer_step_reference.py checks it against
the formulas: HF's loss, torch's clipping and AdamW). With the state sharded, every step's
weights and metrics must equal it within float32 / bf16 rounding, each rank must hold about half
of the optimizer's elements, the weights must survive the offload / onload the colocated loop
does after every step, and a trainer resumed from the export + `train_state` must continue
exactly as the one that never stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import TrainerConfig

from trainer_helpers import torchrun

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
# Every element's update is the same arithmetic on the same values; only the gradient norm
# sums its squares in another grouping (per shard), which can move the clip factor in its last
# bit. The runs are deterministic, and measured equal bitwise in both dtypes.
BOUND = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runs(request, tiny_hf_checkpoints, tmp_path_factory):
    _, directory = tiny_hf_checkpoints("qwen2")
    out = tmp_path_factory.mktemp(f"sharded_{request.param}") / "results.pt"
    torchrun(HERE / "sharded_optimizer_run.py", [str(out), str(directory), request.param])
    return request.param, torch.load(out, weights_only=False)


def test_sharded_steps_equal_the_whole_state_optimizer(runs):
    dtype, res = runs
    for step, ((m_off, w_off), (m_on, w_on)) in enumerate(zip(res["off"], res["on"]), 1):
        assert _max_diff(w_on, w_off) <= BOUND, f"{dtype}, step {step}"
        assert m_on["grad_norm"] == pytest.approx(m_off["grad_norm"], rel=1e-6)
        assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-6, abs=1e-7)
    assert _max_diff(res["off"][-1][1], res["off"][0][1]) > 1e-3  # the weights did move


def test_each_rank_holds_half_the_optimizer_state(runs):
    _, res = runs
    assert res["off_elements"] == [res["params"]] * 2  # whole on every rank
    halves = res["on_elements"]
    assert sum(halves) == res["params"]
    assert all(n <= 0.55 * res["params"] for n in halves), halves


def test_sharded_state_resumes_exactly(runs):
    _, res = runs
    (m_resumed, w_resumed), (m_on, w_on) = res["resumed"][0], res["on"][-1]
    assert _max_diff(w_resumed, w_on) == 0.0
    assert m_resumed == m_on


def test_sharded_state_is_refused_by_the_whole_state_optimizer(runs):
    _, res = runs
    assert "trainer.distributed_optimizer: true" in res.get("refused", "")


def test_sharded_needs_megatron_with_float32_or_bf16():
    for bad in (dict(dtype="float64"), dict(backend="deepspeed")):
        with pytest.raises(ValueError, match="distributed_optimizer=true needs"):
            TrainerConfig(model_path="m", distributed_optimizer=True, **bad)
    # on / off are what YAML reads as booleans; a string is refused
    with pytest.raises(ValueError, match="distributed_optimizer: expected bool | null"):
        TrainerConfig(model_path="m", distributed_optimizer="on")
