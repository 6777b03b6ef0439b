"""Prefill-decode disaggregation with engine TP in the RL loop, end to end on Ray: a 2-step
float64 run with one prefill replica and one decode replica of `rollout.tp=2` each (the trainer
on its own device) has every metrics.jsonl key of the same run with one TP 2 replica doing both
equal but the timings (`test_prefill_decode_e2e.assert_same_run`).
The handoffs carry every KV head (gathered from the prefill replica's two ranks), and each rank
of the decode replica copies its own heads in."""

from __future__ import annotations

import pytest
import shared_ray
from test_prefill_decode_e2e import assert_same_run, run_in_process

pytestmark = pytest.mark.slow

TP2 = ("steps=2", "rollout.tp=2")


@pytest.fixture(scope="module")
def ray_five():
    shared_ray.start(5)  # the trainer and two replicas of two ranks


def test_tp2_prefill_and_decode_replicas_are_the_tp2_run_without(ray_five, cache, tmp_path):
    plain = run_in_process(
        tmp_path / "plain", *TP2, "cluster.devices=3", "cluster.rollout_devices=2"
    )
    pd = run_in_process(
        tmp_path / "pd",
        *TP2,
        "cluster.devices=5",
        "cluster.rollout_devices=4",
        "rollout.prefill_replicas=1",
    )
    assert_same_run(plain, pd)
    assert len(plain) == 2 and all(r["train/grad_norm"] > 0 for r in plain)
