"""No worker process outlives its controller (`miles_like/run/orphans.py`).

A controller killed with SIGKILL runs no cleanup at all; a reward or tool worker idle at that
moment sees its pipe close and exits, but one stuck in a user function that never returns
would live on, re-parented. Here a stand-in controller (`orphan_parent.py`) makes its worker
hang in such a function, then is SIGKILLed: the worker must be gone within seconds.

And `python -m miles_like.train` stopped with SIGTERM (what a scheduler or `kill` sends) must
clean up as on Ctrl-C: exit with 143, leaving no process of its session behind (Ray, engines,
trainer, reward and tool workers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from killed_run import wait_session_gone

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("kind", ["reward", "tool"])
def test_a_hung_worker_dies_with_its_killed_controller(kind):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    parent = subprocess.Popen(
        [sys.executable, str(HERE / "orphan_parent.py"), kind],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = None
    try:
        worker = int(parent.stdout.readline())
        assert psutil.Process(worker).ppid() == parent.pid
        time.sleep(0.5)
        assert psutil.pid_exists(worker)  # hanging in the user function, not exited
        parent.kill()
        parent.wait()
        assert _gone_within(worker, 15.0), f"the {kind} worker {worker} outlived its controller"
    finally:
        parent.kill()
        if worker is not None and psutil.pid_exists(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_stops_a_run_and_every_process_of_it(tmp_path):
    """The calculator agent recipe (engines, trainer, tool workers, reward workers under a
    local Ray), SIGTERMed once its first step has started."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("WANDB_SERVICE", None)
    log = tmp_path / "run.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miles_like.train",
                "recipes/tiny_calc_agent_grpo.yaml",
                "sft.steps=0",
                "steps=50",
                f"tracking.output_dir={out}",
            ],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        workers = []
        while time.monotonic() < deadline and proc.poll() is None and not workers:
            workers = [p for p in psutil.Process(proc.pid).children() if _is_spawned(p)]
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        assert workers, "the run never started its worker processes"
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    leaked = wait_session_gone(proc.pid, timeout=60)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert not leaked, f"processes outlived the SIGTERMed run: {leaked}"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _is_spawned(p: psutil.Process) -> bool:
    """A multiprocessing spawn child (the reward and tool workers)."""
    return any("multiprocessing.spawn" in part for part in _cmdline(p))


def test_a_sigterm_inside_a_blocking_ray_call_still_exits_143(ray_local):
    """A SIGTERM that lands while the controller waits in `ray.wait` (starting engines, say)
    comes out of Ray as its own SystemExit(1); `terminate_gracefully` still ends with 143."""
    import threading

    import ray

    from miles_like.run import orphans

    @ray.remote(num_cpus=0)
    def sleeper():
        time.sleep(60)

    ref = sleeper.remote()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        with pytest.raises(SystemExit) as exited:
            with orphans.terminate_gracefully():
                timer.start()
                ray.wait([ref], timeout=30)
    finally:
        timer.cancel()
        ray.cancel(ref, force=True)
    assert exited.value.code == orphans.SIGTERM_EXIT_CODE
    # without a SIGTERM, another exit keeps its code
    with pytest.raises(SystemExit) as plain:
        with orphans.terminate_gracefully():
            raise SystemExit(1)
    assert plain.value.code == 1
