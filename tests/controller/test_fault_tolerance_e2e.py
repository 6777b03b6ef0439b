"""Fault tolerance, end to end on Ray: actor calls time out instead of hanging, a dead trainer
stops the run cleanly (one line, nonzero exit, checkpoints intact, tracker finished), and an
engine killed mid-rollout is replaced without losing a sample.

Actors are killed with `ray.kill` from a thread of this process while `miles_like.train` runs
in it; the run's actors are found by their names (`miles_like.{run tag}.{role}.{index}`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from miles_like.recipe.cli import main
from miles_like.rollouts.replica_batcher import ReplicaBatcher
from miles_like.run import checkpoint
from miles_like.run.calls import ActorDied, CallTimeout, start_call, wait_all
from miles_like.run.loop import run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")
pytestmark = pytest.mark.slow


@ray.remote
class Sleeper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_wait_all_times_out_and_names_dead_actors(ray_local):
    a, b = Sleeper.remote(), Sleeper.remote()
    naps = [start_call("a", a, "nap", 0.0), start_call("b", b, "nap", 0.1)]
    assert wait_all(naps, 30) == [0.0, 0.1]
    with pytest.raises(
        CallTimeout, match=r"^b nap: no answer within 0.5 s \(cluster.call_timeout_s\)"
    ):
        wait_all([start_call("a", a, "nap", 0.0), start_call("b", b, "nap", 30)], 0.5)
    ray.kill(b)
    with pytest.raises(ActorDied) as e:
        wait_all([start_call("b", b, "nap", 0.0)], 30)
    assert str(e.value) == "b died (during nap): killed by ray.kill"
    # a replacement call takes the dead one's place
    replaced = wait_all(
        [start_call("b", b, "nap", 0.0)],
        30,
        on_death=lambda i, died: start_call("a", a, "nap", 0.2),
    )
    assert replaced == [0.2]


def new_actor(suffix: str, known: set[str], timeout: float = 300):
    """The first named actor ending in `suffix` not in `known` (one created by the run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in ray.util.list_named_actors():
            if name.endswith(suffix) and name not in known:
                return ray.get_actor(name)
        time.sleep(0.05)
    raise AssertionError(f"no actor *{suffix} appeared")


def in_background(fn):
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # surfaced by the test after the run
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def test_trainer_death_stops_the_run_cleanly(ray_local, cache, tmp_path, capsys):
    out = tmp_path / "run"
    known = set(ray.util.list_named_actors())

    def kill_trainer_after_first_checkpoint():
        trainer = new_actor(".trainer.0", known)
        marker = out / "checkpoints" / "step_000001" / checkpoint.STATE_FILE
        while not marker.exists():
            time.sleep(0.01)
        ray.kill(trainer)

    thread, killer = in_background(kill_trainer_after_first_checkpoint)
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            "steps=20",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "sft.steps=0",
            "rollout.kv_cache_tokens=2048",
            "checkpoint.every_steps=1",
            "tracking.wandb_project=miles-like-test",
        ],
        run=run,
    )
    thread.join(timeout=10)
    assert "error" not in killer
    err = capsys.readouterr().err  # tqdm's progress bar, then the error
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "error: trainer rank 0 died: killed by ray.kill; resume with checkpoint.resume=auto"
    )
    # the newest complete checkpoint is whole and loadable, and nothing half-written counts
    latest = checkpoint.complete_checkpoints(out)[-1]
    state = checkpoint.read_state(latest)
    assert state["next_step"] >= 1
    load_file(str(latest / "model.safetensors"))
    torch.load(checkpoint.rank_file(latest, 0), weights_only=True)
    assert all(checkpoint.is_complete(p) for p in (out / "checkpoints").glob("step_*"))
    # the tracker finished: every logged row is whole, the curve and the wandb run are closed
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= state["next_step"]
    assert (out / "reward_curve.png").exists()
    # the run's actors are gone
    assert not [n for n in ray.util.list_named_actors() if n not in known]


def kill_engine_mid_rollout(out: Path, known: set[str], done: threading.Event, monkeypatch) -> None:
    """Engine 0 killed once, in a rollout after the first step's row is logged, right after a
    `generate` call is sent to it: the call is queued or running when the actor dies. (A probe
    of the actor cannot tell its rollout from the weight push that follows a short one, and an
    engine dying during a push ends the run by design; so the kill rides on the call itself.)"""
    engine = new_actor(".engine.0", known)
    metrics, armed, killed = out / "metrics.jsonl", threading.Event(), []
    replaced = ReplicaBatcher.with_replacement

    async def with_a_kill(self, i: int, method: str, requests: int, attempt):
        if not (armed.is_set() and (i, method) == (0, "generate") and not killed):
            return await replaced(self, i, method, requests, attempt)

        async def sent_then_killed():
            call = asyncio.ensure_future(attempt())
            await asyncio.sleep(0)  # the call is sent
            if not killed:
                ray.kill(engine)
                killed.append(method)
            return await call

        return await replaced(self, i, method, requests, sent_then_killed)

    monkeypatch.setattr(ReplicaBatcher, "with_replacement", with_a_kill)
    while not done.is_set() and not armed.is_set():
        if metrics.exists() and metrics.read_text().strip():
            armed.set()
        time.sleep(0.005)


# Few, long samples: a rollout (256 decode steps) outlasts a training step by far, so a kill
# lands mid-rollout.
FEW_LONG_SAMPLES = (
    "steps=4",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_new_tokens=256",
    "sft.steps=0",
    "trainer.updates_per_rollout=1",
    "rollout.kv_cache_tokens=4096",
    "trainer.max_tokens_per_micro_batch=4096",
)


@pytest.mark.parametrize(
    "placement",
    [
        ("cluster.devices=1",),
        ("cluster.devices=2", "cluster.colocate=false", "cluster.off_policy_steps=1"),
    ],
    ids=["colocated", "disaggregated-off-policy"],
)
def test_engine_killed_mid_rollout_is_replaced(
    ray_local, cache, tmp_path, capsys, monkeypatch, placement
):
    """Few, long samples: a rollout (256 decode steps) outlasts a training step by far."""
    out = tmp_path / "run"
    known, done = set(ray.util.list_named_actors()), threading.Event()
    thread, killer = in_background(lambda: kill_engine_mid_rollout(out, known, done, monkeypatch))
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            *FEW_LONG_SAMPLES,
            *placement,
        ],
        run=run,
    )
    done.set()
    thread.join(timeout=10)
    assert code == 0 and "error" not in killer, killer
    printed = capsys.readouterr().out
    assert "engine 0 died (during generate): killed by ray.kill; restarting it" in printed
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["rollout/engine_restarts"] for r in rows) == 1
    for r in rows:  # nothing lost: every prompt's whole group was trained on
        assert r["rollout/samples"] == 2 * 2
    restarted = next(r for r in rows if r["rollout/engine_restarts"])
    if "cluster.off_policy_steps=1" not in placement:
        # on-policy, the replacement generated with the trainer's current weights
        assert restarted["train/logprob_diff_max"] <= 1e-5


def test_an_engine_death_past_the_restart_budget_stops_the_run(
    ray_local, cache, tmp_path, capsys, monkeypatch
):
    """`cluster.max_engine_restarts=0`: the synchronous loop's first engine death stops the run
    with one line naming the field (the same budget bounds the fully asynchronous loop)."""
    out = tmp_path / "run"
    known, done = set(ray.util.list_named_actors()), threading.Event()
    thread, killer = in_background(lambda: kill_engine_mid_rollout(out, known, done, monkeypatch))
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            *FEW_LONG_SAMPLES,
            "cluster.max_engine_restarts=0",
        ],
        run=run,
    )
    done.set()
    thread.join(timeout=10)
    assert "error" not in killer, killer
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err[-2000:]
    assert err.splitlines()[-1] == (
        "error: engine 0 died (during generate): killed by ray.kill; "
        "cluster.max_engine_restarts=0 replacements made already in this run; raise it, or "
        "resume with checkpoint.resume=auto"
    )
