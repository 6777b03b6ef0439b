"""The local Ray a run starts gives its trainer ranks the machine's normal CPU priority (Ray
starts workers at niceness 15 by default, where any other process takes the cores from them),
and `cluster.cpu_threads` sets their torch thread count."""

from __future__ import annotations

import os

import pytest
import ray
import shared_ray
import torch

from miles_like.recipe.sections import ClusterSection
from miles_like.run.placement import create_trainers, plan, release, reserve, start_ray


def test_trainer_ranks_run_at_normal_priority_with_the_recipes_threads():
    shared_ray.stop()  # the local Ray earlier modules left running
    assert not ray.is_initialized()
    cluster = ClusterSection(cpu_threads=1)
    layout = plan(cluster)
    assert layout.threads == 1
    try:
        start_ray(cluster, layout)
        pg = reserve(layout)
        trainers = create_trainers(layout, pg, "priority-test", timeout_s=300.0)
        # a lambda travels by value (the actor cannot import this test module)
        probe = lambda worker: (os.nice(0), torch.get_num_threads())  # noqa: E731
        niceness, threads = ray.get(trainers[0].__ray_call__.remote(probe))
        assert niceness == os.nice(0)  # the driver's own, not Ray's default of 15
        assert threads == 1
        release(pg, trainers)
    finally:
        ray.shutdown()


def test_cpu_threads_default_splits_the_cores_over_the_devices(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert plan(ClusterSection()).threads == max(1, cores)
    assert plan(ClusterSection(devices=2)).threads == max(1, cores // 2)
    assert plan(ClusterSection(cpu_threads=3)).threads == 3


@pytest.mark.parametrize(("omp", "want"), [("1", 1), ("1,1", 1), ("64", None), ("", None)])
def test_cpu_threads_default_is_capped_by_omp_num_threads(monkeypatch, omp, want):
    """`make test` runs two pytest processes with OMP_NUM_THREADS=1: their runs' workers take
    one thread each, not the machine's cores each. A larger value or none leaves the split."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert plan(ClusterSection()).threads == (want or max(1, cores))
    assert plan(ClusterSection(cpu_threads=2)).threads == 2  # an explicit value wins
