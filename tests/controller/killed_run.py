"""A training run killed with SIGKILL while the test does something else: the end-to-end
resume tests' way to stop a run at a moment the run does not choose.

`python -m miles_like.train` runs in its own session (its own local Ray); a watcher thread
SIGKILLs the whole process group once a marker file exists (a checkpoint's state.json), after a
chosen delay, while the caller's block runs. No process of the session may outlive the kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Kill:
    """What the watcher saw when it struck (filled in by the time the block has run)."""

    saw_marker: list[bool] = field(default_factory=list)  # a later checkpoint may delete it
    rows_at_kill: list[int] = field(default_factory=list)  # metrics.jsonl rows when killed


@contextmanager
def killed_run(
    out: Path,
    args: Sequence[str],
    marker: Path,
    delay_s: float = 0.0,
    timeout: float = 900,
    module: str = "miles_like.train",
) -> Iterator[Kill]:
    """Starts `python -m miles_like.train *args tracking.output_dir=out` on entry (`module`:
    another entry point taking the same arguments, e.g. one of this directory's); SIGKILLs it
    `delay_s` after `marker` appears. Leaving the block waits for the kill and asserts the
    marker was seen and nothing of the killed session survived."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]),
        PYTHONUNBUFFERED="1",
    )  # its log is read while it runs
    env.pop("WANDB_SERVICE", None)  # this process's wandb service: the run gets its own
    out.mkdir(parents=True)
    log_path = out.parent / f"{out.name}.log"
    kill = Kill()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, f"tracking.output_dir={out}"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def kill_after_marker():
            deadline = time.monotonic() + timeout
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            kill.saw_marker.append(marker.exists())
            time.sleep(delay_s)
            metrics = out / "metrics.jsonl"
            kill.rows_at_kill.append(
                len(metrics.read_text().splitlines()) if metrics.exists() else 0
            )
            kill_group(proc.pid)

        watcher = threading.Thread(target=kill_after_marker, daemon=True)
        try:
            # Ray gives a starting node 30 s (hard-coded) to register: let it start before the
            # caller's block competes for the 2 cores (the warm start runs on its actors)
            deadline = time.monotonic() + 300
            while (
                "warm start:" not in log_path.read_text()
                and proc.poll() is None
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            watcher.start()
            yield kill
            watcher.join(timeout=timeout)
        finally:
            kill_group(proc.pid)
            proc.wait()
            leaked = wait_session_gone(proc.pid, timeout=30)
    assert kill.saw_marker == [True], log_path.read_text()[-3000:]
    assert not leaked, f"processes outlived the killed run: {leaked}"


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone (killed by the watcher)
        pass


def wait_session_gone(sid: int, timeout: float) -> list[str]:
    """Wait for every process of session `sid` to exit; kill (by pid) and name any that do not."""

    def members():
        found = []
        for p in psutil.process_iter(["name"]):
            try:
                if os.getsid(p.pid) == sid:
                    found.append(p)
            except (ProcessLookupError, PermissionError):
                pass
        return found

    deadline = time.monotonic() + timeout
    while (left := members()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:
        p.kill()
    return [f"{p.pid} {p.info['name']}" for p in left]
