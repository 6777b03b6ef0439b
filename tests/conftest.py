"""Shared pytest set-up.

pytest's rootdir-relative `conftest.py` puts `tests/` on `sys.path` (rootdir conftest, rootdir
insertion), so test modules import the reference helpers as `from tiny_hf import ...`.

Fixtures here build the tiny random-init Hugging Face checkpoints of `tiny_hf.py` once per
session and save them to a temporary directory, so every test that compares against HF
transformers loads the same weights from disk.
"""

from __future__ import annotations

import os
import sys

# Triton decides between compiling and interpreting when `triton.language` and each kernel are
# first imported, and torch may import triton early (its native-op registrations do, on first
# use). The kernel tests run interpreted on CPU (tests/kernels/conftest.py), so the process is
# set to interpret before anything can import triton; nothing else in the suite runs Triton.
os.environ["TRITON_INTERPRET"] = "1"
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


def pytest_sessionfinish(session, exitstatus):
    import shared_ray

    shared_ray.stop()


def pytest_collection_modifyitems(config, items):
    """Files with `slow` (end-to-end) tests first, each file's tests kept together and in order.

    `make test` runs the files in two processes (pytest-xdist, `--dist loadfile
    --no-loadscope-reorder`: files handed out in this order as a process frees up). The
    end-to-end files take minutes each and the rest seconds, so starting the long ones first
    and filling in with the short ones ends both processes close together."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order is kept
