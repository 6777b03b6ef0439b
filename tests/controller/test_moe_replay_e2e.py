"""Routing replay end to end on the built-in mixture of experts (`model.builtin: tiny-qwen3-moe`,
float64): every trained token is routed in the trainer to the experts the engine routed it to,
so the engine-vs-trainer log-probs agree to rounding (`train/logprob_diff_max` <= 1e-10) and the
first update's PPO-KL is exactly 0, colocated (two data-parallel trainer ranks, each given only
its own samples' routes), disaggregated and fully asynchronous. The deepspeed backend replays on
HF's mixture (`trainer.hf_routing_replay`), float32 (it has no float64 path): two data-parallel
ranks, each given only its own samples' routes (a rank missing one it packs is refused), the
first update's PPO-KL exactly 0 and engine-vs-trainer log-probs within the float32 bound. The
runs are the dense tests' (`test_oversampling_e2e`, `test_async_e2e`) with the model swapped, at
their temperatures (T != 1 included: both sides divide by the same T); over-sampling with
retract and a kill -9 resume is `test_oversampling_e2e`'s `moe` case.
"""

from __future__ import annotations

import pytest
import test_async_e2e
import test_oversampling_e2e
from test_oversampling_e2e import MOE

pytestmark = pytest.mark.slow


# the built-in tiny-qwen3-moe's routes per token: 2 sparse layers x top-2 expert ids of 1 byte
# each (8 experts fit a uint8)
ROUTE_BYTES_PER_TOKEN = 2 * 2 * 1


def replayed_exactly(rows: list[dict], logprob_bound: float = 1e-10) -> None:
    """Every step: engine-vs-trainer log-probs within `logprob_bound` (float64's by default),
    first-update PPO-KL exactly 0, routes shipped (their bytes the closed form per token) and
    the agreement reported."""
    assert rows
    for r in rows:
        assert r["train/logprob_diff_max"] <= logprob_bound
        assert r["train/ppo_kl_first_update"] == 0.0
        assert r["rollout/route_bytes"] > 0 and 0.0 <= r["train/routing_agreement"] <= 1.0
        assert r["rollout/route_bytes"] == ROUTE_BYTES_PER_TOKEN * r["rollout/route_tokens"]


def test_colocated_two_trainer_ranks(ray_local, cache, tmp_path):
    rows = test_oversampling_e2e.run_in_process(
        tmp_path / "colocated", *MOE, "steps=2", "checkpoint.every_steps=0", "cluster.devices=2"
    )
    replayed_exactly(rows)
    # with replay off nothing is shipped nor replayed; the same run otherwise
    off = test_oversampling_e2e.run_in_process(
        tmp_path / "off",
        *MOE,
        "steps=1",
        "checkpoint.every_steps=0",
        "cluster.devices=2",
        "algorithm.routing_replay=off",
    )
    assert "rollout/route_bytes" not in off[0] and "train/routing_agreement" not in off[0]
    assert "rollout/route_tokens" not in off[0]


def test_disaggregated_and_fully_async(ray_local, cache, tmp_path):
    def runner(out, *overrides):
        return test_async_e2e.run_in_process(out, *MOE, *overrides)

    sync, asynchronous = test_async_e2e.sync_and_zero_staleness_runs(runner, tmp_path)
    replayed_exactly(sync)
    replayed_exactly(asynchronous)


def test_deepspeed_two_trainer_ranks(ray_local, cache, tmp_path):
    rows = test_oversampling_e2e.run_in_process(
        tmp_path / "deepspeed",
        *MOE,
        "model.dtype=float32",
        "trainer.backend=deepspeed",
        "trainer.zero_stage=2",
        "steps=2",
        "checkpoint.every_steps=0",
        "cluster.devices=2",
    )
    replayed_exactly(rows, logprob_bound=1e-5)
