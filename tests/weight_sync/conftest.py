"""Fixtures shared by the weight-sync tests."""

from __future__ import annotations

import pytest

from tiny_hf import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """(old, new): two tiny Qwen2 checkpoints of different seeds; the engine starts from old,
    the 'trainer' holds new. (A module may define its own, e.g. in another dtype.)"""
    old = save_hf_model(make_hf_model("qwen2", seed=0), tmp_path_factory.mktemp("old"))
    new = save_hf_model(make_hf_model("qwen2", seed=1), tmp_path_factory.mktemp("new"))
    return old, new
