"""Fixtures of the end-to-end controller tests: a local Ray instance per test module (as CI
starts it: 2 CPUs, no dashboard) and a warm-start / built-in model cache shared by the module's
runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _local_ray(num_cpus: int):
    import ray

    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here)])
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    yield from _local_ray(2)


@pytest.fixture(scope="module")
def ray_four():
    """A local Ray with 4 logical CPUs (4 one-CPU bundles on a smaller machine: the actors
    share its cores)."""
    yield from _local_ray(4)


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "miles_like_cache"  # shared by this session's runs
    monkeypatch.setenv("MILES_LIKE_CACHE", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return root
