"""Trainer test fixtures: tiny HF checkpoint dirs, the single-process scenario, torchrun runs.

The pytest process itself is a 1-process gloo world (TP = PP = DP = 1) once any trainer test
initializes megatron; multi-process layouts run under torchrun in subprocesses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from trainer_helpers import FAMILIES, torchrun  # noqa: E402


@pytest.fixture(scope="session")
def hf_dirs(tiny_hf_checkpoints):
    return {f: tiny_hf_checkpoints(f)[1] for f in FAMILIES}


@pytest.fixture(scope="session")
def single_process_results(hf_dirs):
    """scenarios.run on every family in this process (TP = PP = DP = 1)."""
    import scenarios

    return {f: scenarios.run(str(d)) for f, d in hf_dirs.items()}


# layout -> (backend, TP, PP, families); every layout runs 2 processes over gloo.
PARALLEL_LAYOUTS = {
    "tp2": ("megatron", 2, 1, FAMILIES),
    "pp2": ("megatron", 1, 2, FAMILIES),
    "dp2": ("megatron", 1, 1, ("qwen2",)),
    "deepspeed-dp2": ("deepspeed", 1, 1, ("qwen3",)),
    "zero3-dp2": ("deepspeed-zero3", 1, 1, ("qwen3",)),
}


@pytest.fixture(scope="session")
def parallel_results(hf_dirs, tmp_path_factory):
    """layout -> {family: scenarios.run results}: all layouts in one torchrun launch (process
    start-up and imports dominate these tiny runs)."""
    import json

    plan = [
        [layout, backend, tp, pp, [str(hf_dirs[f]) for f in families]]
        for layout, (backend, tp, pp, families) in PARALLEL_LAYOUTS.items()
    ]
    out = tmp_path_factory.mktemp("parallel") / "results.pt"
    torchrun(HERE / "scenarios.py", [str(out), json.dumps(plan)], timeout=500)
    by_layout = torch.load(out, weights_only=False)
    return {
        layout: {f: by_layout[layout][str(hf_dirs[f])] for f in families}
        for layout, (_, _, _, families) in PARALLEL_LAYOUTS.items()
    }


def pytest_configure(config):
    # megatron-core 0.16.1 warns on every layer build / TP call about APIs it is migrating;
    # none of them concern this code, and they bury real warnings.
    for line in ("ignore::DeprecationWarning:megatron.*", "ignore::UserWarning:megatron.*"):
        config.addinivalue_line("filterwarnings", line)
