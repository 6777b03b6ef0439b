"""Fixtures of the end-to-end controller tests: a local Ray instance per test module (as CI
starts it: 2 CPUs, no dashboard) and a warm-start / built-in model cache shared by the module's
runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(here)])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "miles_like_cache"  # shared by this session's runs
    monkeypatch.setenv("MILES_LIKE_CACHE", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return root
