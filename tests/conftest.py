"""Shared pytest set-up.

pytest's rootdir-relative `conftest.py` puts `tests/` on `sys.path` (rootdir conftest, rootdir
insertion), so test modules import the reference helpers as `from tiny_hf import ...`.

Fixtures here build the tiny random-init Hugging Face checkpoints of `tiny_hf.py` once per
session and save them to a temporary directory, so every test that compares against HF
transformers loads the same weights from disk.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))
# With tests/ on sys.path, the folder tests/rollout/ (no __init__.py) would be imported as a
# namespace package `rollout` unless the real package is found on sys.path too: a regular
# package anywhere on sys.path wins over namespace portions, the editable-install finder does not.
_REPO_ROOT = _TESTS_DIR.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.append(str(_REPO_ROOT))


@pytest.fixture(scope="session")
def tiny_hf_checkpoints(tmp_path_factory):
    """family -> (HF model in eval mode, directory with config.json + model.safetensors).

    Built lazily per family and cached for the session."""
    from tiny_hf import make_hf_model, save_hf_model

    cache: dict[str, tuple[object, Path]] = {}

    def get(family: str):
        if family not in cache:
            model = make_hf_model(family)
            directory = save_hf_model(model, tmp_path_factory.mktemp(f"hf_{family}"))
            cache[family] = (model, directory)
        return cache[family]

    return get
