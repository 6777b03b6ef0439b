"""`rollout.host_heap`: after `keep_freed_memory`, a forward-like pattern of C heap allocations
(several intermediates of a few MiB, written, all freed, again and again) reuses its pages
instead of faulting in fresh ones; with glibc's default thresholds the same pattern faults in
every round (the control, so the test can fail). Each run is a fresh process: the setting is
process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ROUNDS = r"""
import ctypes, resource, sys
sys.path.insert(0, sys.argv[1])
from rollout import host_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[2] == "keep":
    assert host_heap.keep_freed_memory()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(12 << 20) for _ in range(4)]  # four 12 MiB intermediates, written
    for block in blocks:
        libc.memset(block, 1, 12 << 20)
    for block in blocks:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[1:]))  # rounds after the first
"""

PAGES_PER_ROUND = 4 * (12 << 20) // 4096


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, str(ROOT), mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_intermediates_are_reused_without_page_faults():
    assert _faults("default") > PAGES_PER_ROUND // 2  # glibc's dynamic thresholds: fresh pages
    assert _faults("keep") < PAGES_PER_ROUND // 50
