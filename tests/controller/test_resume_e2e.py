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
from pathlib import Path

import pytest
from killed_run import killed_run

from miles_like.recipe.cli import main
from miles_like.run.loop import run

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
        "rollout/pd_transfer_s",  # prefill-decode: the handoffs' transfer time, per request
    )


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_in_process(out: Path, *overrides: str) -> None:
    assert main([RECIPE, f"tracking.output_dir={out}", *COMMON, *overrides], run=run) == 0


def killed_after_checkpoint(out: Path, step: int, *overrides: str):
    """The run SIGKILLed as soon as checkpoint `step` is complete, while the caller's block
    runs."""
    marker = out / "checkpoints" / f"step_{step:06d}" / "state.json"
    return killed_run(out, [RECIPE, *COMMON, *overrides], marker)


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
