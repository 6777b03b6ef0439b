"""One local Ray shared by consecutive test modules of the same size (as CI starts it: no
dashboard, on loopback, the test directories on the workers' path).

Starting a local Ray and stopping it costs seconds, and most end-to-end modules want the same
2-CPU instance, so it is left running when a module ends and taken over by the next one that
asks for that size. A module that asks for another size, or finds the instance still busy
(an actor or a placement group of an earlier module holding resources: a run that did not clean
up), gets a fresh one. Modules that start Ray their own way call `stop()` first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# the repository first: tests/rollout, tests/trainer must not shadow the packages
PATH = os.pathsep.join(str(p) for p in (ROOT, TESTS, TESTS / "controller"))

_num_cpus: int | None = None  # the running instance's size


def _idle(ray, wait_s: float = 5.0) -> bool:
    """Every resource free (an actor's are returned shortly after it is killed)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources() != ray.cluster_resources():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def start(num_cpus: int) -> None:
    global _num_cpus
    import ray

    if ray.is_initialized() and (_num_cpus != num_cpus or not _idle(ray)):
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"PYTHONPATH": PATH}},
        )
        _num_cpus = num_cpus


def stop() -> None:
    ray = sys.modules.get("ray")  # not imported: nothing is running
    if ray is not None and ray.is_initialized():
        ray.shutdown()
