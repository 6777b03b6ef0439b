"""Fixtures of the end-to-end controller tests: a local Ray (as CI starts it: 2 CPUs, no
dashboard; shared by consecutive modules, `tests/shared_ray.py`) and a warm-start / built-in
model cache shared by the session's runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import shared_ray

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_local():
    shared_ray.start(2)  # left running for the next module of the same size


@pytest.fixture(scope="module")
def ray_four():
    """A local Ray with 4 logical CPUs (4 one-CPU bundles on a smaller machine: the actors
    share its cores)."""
    shared_ray.start(4)


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "miles_like_cache"  # shared by this session's runs
    monkeypatch.setenv("MILES_LIKE_CACHE", str(root))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return root
