"""A mixture of experts' weights through the trainer -> engine push, in the real loop
(`model.builtin: tiny-qwen3-moe`, the default recipe's first steps in float64, real Ray actors):
after the last sync every engine rank's parameters (the router and every expert's gate / up /
down projections, sharded over the engine's TP ranks like the dense MLP) are bitwise equal to
slices of the megatron trainer's export, written out from the layout rules (`tp_slices.py`,
sharing no code with the engine's loader or the bridge).

* colocated, engine TP = 2, trainer TP = 1 (data parallel 2): the full tensors go to engine
  rank 0, which hands each follower its slices; trainer TP = 2: the resharding sync, each
  trainer rank sends exactly its engine rank's slices (experts split by the trainer's TP);
* disaggregated (the broadcast transport), engine TP = 1: the whole experts.
"""

from __future__ import annotations

import pytest
import torch
from engine_tp_runs import assert_ranks_hold_slices, run_tp_recipe

pytestmark = pytest.mark.slow

SEED = 0
# the entropy bonus moves every weight even when a group's rewards are all equal
MOE = (
    "model.builtin=tiny-qwen3-moe",
    "trainer.updates_per_rollout=1",
    "algorithm.entropy_coef=0.01",
    f"seed={SEED}",
)


def _assert_experts_trained(result) -> None:
    """The pushed router and experts are not the initial ones (the run's base model, built
    from the same seed), so the engine holds what the trainer trained."""
    from safetensors.torch import load_file

    from miles_like.models.store import base_model_dir
    from miles_like.recipe.sections import ModelSection

    initial = load_file(
        base_model_dir(ModelSection(builtin="tiny-qwen3-moe"), SEED) / "model.safetensors"
    )
    moved = [
        n
        for n, t in result.trainer_hf.items()
        if (".mlp.experts." in n or n.endswith(".mlp.gate.weight"))
        and not torch.equal(t, initial[n])
    ]
    assert any(n.endswith(".mlp.gate.weight") for n in moved)
    assert any(".mlp.experts." in n for n in moved)


@pytest.mark.parametrize("trainer_tp", [1, 2])
def test_moe_experts_reach_a_tp2_engine_colocated(
    ray_local, cache, tmp_path, monkeypatch, trainer_tp
):
    result = run_tp_recipe(
        tmp_path, monkeypatch, *MOE, f"trainer.tp={trainer_tp}", "cluster.devices=2"
    )
    assert [r["step"] for r in result.rows] == [0, 1]
    assert any(".mlp.experts.7.down_proj." in n for n in result.trainer_hf)
    expected_bytes = assert_ranks_hold_slices(result)
    _assert_experts_trained(result)
    for r in result.rows:
        assert r["train/logprob_diff_max"] <= 1e-10
        if trainer_tp == 2:  # the resharding sync: each trainer rank sent its engine rank's slices
            assert r["perf/weight_sync_bytes_per_rank"] == max(expected_bytes)
            assert r["perf/weight_sync_bytes"] == sum(expected_bytes)


def test_moe_experts_reach_the_engine_by_broadcast(ray_local, cache, tmp_path, monkeypatch):
    result = run_tp_recipe(
        tmp_path,
        monkeypatch,
        *MOE,
        "rollout.tp=1",
        "cluster.devices=2",
        "cluster.colocate=false",
        "cluster.rollout_devices=1",
    )
    assert_ranks_hold_slices(result, k=1)
    _assert_experts_trained(result)
    for r in result.rows:
        assert r["train/logprob_diff_max"] <= 1e-10
