"""Running a benchmark script the way a user does, for the benchmarks' smoke tests: a
subprocess of this Python in the repository root, whose stdout is exactly one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def benchmark_process(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT ARGS...`, finished (its exit code and output captured)."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_benchmark(script: str, *args: str, timeout: float = 600) -> dict:
    """`benchmark_process` that must succeed: the JSON object it printed."""
    proc = benchmark_process(script, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)
