"""The GPU suite's sections import our modules inside their functions (they run only with CUDA,
so the dry run in CI never executes those lines). A renamed or moved name would surface only on
the device, minutes into a scarce budget: here every `from <our package> import <name>` in every
section resolves, on CPU."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

SECTIONS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite" / "sections"
OURS = (
    "rollout",
    "trainer",
    "weight_sync",
    "miles_like",
    "model_spec",
    "collectives",
    "quantization",
)


def _imports() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(SECTIONS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in OURS:
                    found += [(path.name, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    (path.name, alias.name, "")
                    for alias in node.names
                    if alias.name.split(".")[0] in OURS
                ]
    return found


def test_sections_import_our_code():
    assert _imports(), "no section imports our packages: the scan is broken"


@pytest.mark.parametrize("section, module, name", _imports())
def test_every_name_a_section_imports_exists(section, module, name):
    imported = importlib.import_module(module)
    if name:
        assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), (
            f"{section}: from {module} import {name}: no such name"
        )
