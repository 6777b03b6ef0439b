"""Exact resume, end to end: a run SIGKILLed right after a checkpoint and then resumed with
`checkpoint.resume: auto` logs exactly the metrics of a run never stopped (every key but the
timings), on CPU with the same seed (in the recipe's float64).

The killed run is `python -m miles_like.train` in its own session, starting its own local Ray;
the whole process group is SIGKILLed, and no process of the session may outlive it. The
uninterrupted and the resumed runs share this module's Ray instance. The training is made to
depend on every piece of saved state: a dense reward (the response length) so every step has a
gradient, two Adam updates per step, a warmup + cosine LR schedule, and a warm start that the
resumed run must not redo (the checkpoint holds the weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from miles_like.cli import main
from miles_like.loop import run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")
pytestmark = pytest.mark.slow

STEPS = 6
KILL_AFTER = 3  # the checkpoint before step 3 (written after step 2)
COMMON = (
    f"steps={STEPS}",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "rollout.kv_cache_tokens=2048",
    "sft.steps=10",
    "sft.batch_size=16",
    "sft.cache=false",
    "trainer.updates_per_rollout=2",
    "trainer.lr=3e-3",
    "trainer.lr_schedule=cosine",
    "trainer.warmup_steps=2",
    "reward.function=user_rewards:length_score",
    "checkpoint.every_steps=1",
    "tracking.wandb_project=miles-like-test",
)


def is_timing(key: str) -> bool:
    return (key.startswith("perf/") and key.endswith(("_s", "_frac", "_frac_min"))) or key in (
        "perf/engine_occupancy",  # weighted by the passes' durations
        "rollout/tokens_per_s",
    )


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_in_process(out: Path, *overrides: str) -> None:
    assert main([RECIPE, f"tracking.output_dir={out}", *COMMON, *overrides], run=run) == 0


@contextmanager
def killed_after_checkpoint(out: Path, step: int, *overrides: str):
    """`python -m miles_like.train` in its own session (its own local Ray), started on entry and
    SIGKILLed as a whole process group as soon as checkpoint `step` is complete, by a watcher
    thread, while the caller's block runs."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]),
        PYTHONUNBUFFERED="1",
    )  # its log is read while it runs
    env.pop("WANDB_SERVICE", None)  # this process's wandb service: the run gets its own
    marker = out / "checkpoints" / f"step_{step:06d}" / "state.json"
    out.mkdir(parents=True)
    log_path = out.parent / f"{out.name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miles_like.train",
                RECIPE,
                f"tracking.output_dir={out}",
                *COMMON,
                *overrides,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def kill_at_marker():
            deadline = time.monotonic() + 600
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            _kill_group(proc.pid)

        watcher = threading.Thread(target=kill_at_marker, daemon=True)
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
            yield
            watcher.join(timeout=600)
        finally:
            _kill_group(proc.pid)
            proc.wait()
            leaked = _wait_session_gone(proc.pid, timeout=30)
    assert marker.exists(), log_path.read_text()[-3000:]
    assert not leaked, f"processes outlived the killed run: {leaked}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone (killed by the watcher)
        pass


def _wait_session_gone(sid: int, timeout: float) -> list[str]:
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


def assert_same_rows(resumed: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for a, b in zip(resumed, reference):
        keys = {k for k in a.keys() | b.keys() if not is_timing(k)}
        diff = {k: (a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"


def check_resumed_exactly(tmp_path: Path, capsys, *overrides: str) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    with killed_after_checkpoint(killed, KILL_AFTER, *overrides):
        run_in_process(reference, *overrides)  # meanwhile (most of a start-up is waiting)
    capsys.readouterr()
    run_in_process(killed, "checkpoint.resume=auto", *overrides)
    printed = capsys.readouterr().out
    resumed_from = int(printed.split("resume: continuing from ")[1].split("step_")[1][:6])
    assert KILL_AFTER <= resumed_from < STEPS
    assert "warm start:" not in printed  # the checkpoint holds the weights
    ref_rows = rows_of(reference)
    # every step made a real update, so a missing piece of optimizer state would show
    assert all(r["train/grad_norm"] > 0 and r["train/update_skipped"] == 0 for r in ref_rows)
    assert len({r["train/lr"] for r in ref_rows}) == STEPS  # the schedule moved every step
    assert_same_rows(rows_of(killed), ref_rows)
    # wandb continued the killed run's id (one offline directory per process, same id)
    ids = {p.name.rsplit("-", 1)[1] for p in (killed / "wandb").glob("offline-run-*")}
    assert len(ids) == 1 and len(list((killed / "wandb").glob("offline-run-*"))) == 2
    # the newest checkpoints are complete; nothing half-written is left behind
    names = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert names == [f"step_{STEPS - 1:06d}", f"step_{STEPS:06d}"]


def test_colocated_on_policy_resume_is_exact(ray_local, cache, tmp_path, capsys):
    check_resumed_exactly(tmp_path, capsys)


def test_disaggregated_off_policy_resume_is_exact(ray_local, cache, tmp_path, capsys):
    """One-step off-policy: the pending rollout is regenerated with the engine-side weights
    saved in the checkpoint (one version behind the policy)."""
    check_resumed_exactly(
        tmp_path,
        capsys,
        "cluster.devices=2",
        "cluster.colocate=false",
        "cluster.off_policy_steps=1",
    )
