"""benchmarks/weight_sync.py's colocated run talks to its engine process over a pipe: when that
process dies, the benchmark must fail at once (EOFError) instead of waiting forever on a pipe
whose other end it still holds itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys
sys.path.insert(0, {repo!r})
from benchmarks.weight_sync import run_colocated
try:
    run_colocated("/nonexistent/model", {{}}, 1 << 20, verify=True, syncs=1)
except EOFError:
    print("EOFError")
"""


def test_a_dead_engine_process_fails_the_run_instead_of_hanging_it():
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(repo=str(REPO))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip() == "EOFError", proc.stderr[-2000:]
    assert "FileNotFoundError" in proc.stderr  # the engine process's own error, as it died
