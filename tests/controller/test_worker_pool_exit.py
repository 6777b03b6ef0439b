"""A run that stops (SIGTERM, an error) while a rollout thread is still starting a worker pool
(the reward pool starts on first use) must not wait for that start: the interpreter joins the
thread at exit, and the thread used to wait up to `STARTUP_TIMEOUT_S` for a worker still
importing. Measured against a worker that takes 60 s to start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from miles_like.worker_pool import STARTUP_TIMEOUT_S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.parametrize("thread", ["executor", "plain"])
def test_exit_does_not_wait_for_a_starting_worker(thread):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "slow_start_pool.py"), "2.0", thread],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    took = time.monotonic() - start
    assert STARTUP_TIMEOUT_S > 45 and took < 45
    assert "main returns" in out
    assert "pool: slow_setup: a worker process was still starting when the process exited" in out
