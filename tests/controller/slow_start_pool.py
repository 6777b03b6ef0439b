"""A stand-in controller for test_worker_pool_exit.py: a thread of an executor (as the rollouts'
asyncio loop runs a reward call) starts a WorkerPool whose workers take a minute to start (a
slow import); the main thread then returns. The interpreter joins executor threads at exit
before it marks the main thread stopped, and plain threads after."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from miles_like.worker_pool import WorkerPool


def slow_setup(seconds: float):
    time.sleep(seconds)
    return lambda job: job


def start_pool() -> None:
    try:
        WorkerPool(slow_setup, (60.0,), size=1, timeout_s=5.0, what="slow_setup")
    except RuntimeError as e:
        print(f"pool: {e}", flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "executor":
        ThreadPoolExecutor(1).submit(start_pool)
    else:
        threading.Thread(target=start_pool, name="rollout-thread").start()
    time.sleep(float(sys.argv[1]))  # let the worker start spawning
    print("main returns", flush=True)
