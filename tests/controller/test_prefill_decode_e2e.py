"""Prefill-decode disaggregation (`rollout.prefill_replicas`) in the RL loop, end to end on Ray.

* A 3-step float64 run with one prefill replica and two decode replicas has every metrics.jsonl
  key of the same run without it (the two decode replicas serving alone) equal but the
  timings: the same tokens, rewards, updates and prefix-cache hit rates (both decode
  replicas' batches leave as one wave, prefilled in one call, as each plain replica prefills
  its own batch in one call), log-probs within 1e-12 (that call's forward is larger than each
  plain replica's, so the first tokens' log-probs may differ in their last bits). It adds the
  transfer's `rollout/pd_transfer_bytes` (the handoffs' K/V, per request) and
  `rollout/pd_transfer_s`, and `rollout/pd_local_prefills` (0 here: single turns).
* The same for multi-turn sessions (the calculator tool loop, float64; floats within 1e-12:
  the decode batches differ, so log-probs may differ in their last bits), the hit rates
  included: a later turn whose new part is short is prefilled on its session's decode replica,
  which holds the earlier turns whole, as the plain replica does
  (`rollout.pd_local_prefill_tokens`, `rollout/pd_local_prefills` counts them). With that
  threshold 0 every later turn is prefilled again on the prefill replica and the hit rates are
  at most the plain run's: the prefill replica never saw the completions, so a later turn
  finds only the earlier prompts in its cache.
* Colocated (each replica shares a device with a trainer rank, releasing it while the trainer
  trains): one prefill and two decode replicas against three plain replicas, the same trainer;
  floats within 1e-12 (the decode batches differ from the plain replicas').
* A mixture of experts with routing replay (`tiny-qwen3-moe`, float64): the decode
  replicas return every sample's routes (the prompt's from the prefill replica's handoff), so
  the trainer replays them and engine-vs-trainer log-probs agree to 1e-10, the first update's
  PPO-KL exactly 0.
* Streaming scoring (`rollout.stream_scoring`: each group scored as soon as it finishes): the
  same as the run without, the hit rates at least its (the over-sampled path prefills each
  decode replica's share in its own call: a later call finds an earlier one's prompts).
* Over-sampled with partial rollouts (`over_sampling: 2`, `partial: retract`): the same as the
  run without, and every fresh group launched is trained once or still carried (counted).
* The same with `partial: in_place`: a carried sample's continuation goes to its decode replica
  directly (no prefill replica, nothing re-sent), which adopts the K/V it parked: the parked
  tokens reused (`rollout/in_place_reused_tokens`) equal the run without's, and are not zero.
* The prefill replica killed after the first step and a decode replica killed mid-rollout (right
  after a later step's decode call is sent to it): both are replaced (two restarts counted),
  the run completes and every step trains every prompt's whole group once.
"""

from __future__ import annotations

import operator
import re
import threading
import time
from pathlib import Path

import pytest
import ray
from test_fault_tolerance_e2e import FEW_LONG_SAMPLES, in_background, new_actor
from test_moe_replay_e2e import replayed_exactly
from test_oversampling_e2e import MOE
from test_resume_e2e import RECIPE, is_timing, rows_of

from miles_like.recipe.cli import main
from miles_like.rollouts.prefill_then_decode import PrefillDecode
from miles_like.run.loop import run

pytestmark = pytest.mark.slow

BASE = (
    "steps=3",
    "checkpoint.every_steps=0",
    "rollout.prompts_per_step=4",
    "rollout.n=2",
    "rollout.max_new_tokens=8",
    "rollout.kv_cache_tokens=4096",
    "rollout.temperature=0.8",
    "reward.function=user_rewards:length_score",
    "sft.steps=10",
    "sft.batch_size=16",
    # a test's runs start from one warm start (the `cache` fixture's MILES_LIKE_CACHE): the
    # comparisons begin from the same weights, and the calc agent's 120 steps run once
    "sft.cache=true",
    "trainer.lr=3e-3",
    "tracking.wandb_project=null",
    "cluster.colocate=false",
    "cluster.cpu_threads=1",
)
TWO_REPLICAS = ("cluster.devices=3", "cluster.rollout_devices=2")
ONE_PREFILL_TWO_DECODE = (
    "cluster.devices=4",
    "cluster.rollout_devices=3",
    "rollout.prefill_replicas=1",
)


def run_in_process(out: Path, *overrides: str, recipe: str = RECIPE) -> list[dict]:
    assert main([recipe, f"tracking.output_dir={out}", *BASE, *overrides], run=run) == 0
    return rows_of(out)


HIT_RATES = ("rollout/prefix_cache_hit_rate", "rollout/prefix_cache_hit_rate_turn2plus")


def differs(a, b, atol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) > atol
    return a != b


# the transfer's keys, and the requests prefilled on their own decode replica
PD_KEYS = {"rollout/pd_transfer_bytes", "rollout/pd_transfer_s", "rollout/pd_local_prefills"}


HIT_RATE_BOUNDS = {  # pd's hit rates against the plain run's
    "equal": operator.eq,
    "at_least": operator.ge,
    "at_most": operator.le,
    "any": lambda pd, plain: True,
}


def assert_same_run(
    plain: list[dict],
    pd: list[dict],
    atol: float = 0.0,
    hit_rates: str = "equal",
    transfers_every_step: bool = True,
) -> None:
    """Every key equal but timings (floats within `atol`), and the prefix-cache hit rates
    `hit_rates` the plain run's: "equal" (a wave's batches prefilled in one call, as each plain
    replica prefills its own), "at_least" (the over-sampled streams: one prefill call per
    decode replica, a later one finding an earlier one's prompts in the cache), "at_most"
    (later turns: the prefill replica never saw the completions) or "any" (continuations
    adopting parked K/V compute on the decode replicas, outside the prefill replica's
    counters). Every step moved handoffs (its row has the transfer's keys), or with
    `transfers_every_step=False` some step did and the others prefilled nothing (in_place:
    only continuations on their decode replicas, or no request at all)."""
    bound = HIT_RATE_BOUNDS[hit_rates]
    assert len(plain) == len(pd)
    for s, p in zip(plain, pd):
        same = [k for k in sorted(s) if not is_timing(k) and k not in HIT_RATES]
        diff = {k: (s[k], p.get(k)) for k in same if differs(s[k], p.get(k), atol)}
        assert not diff, f"step {s['step']}: {diff}"
        rates = {k: (s[k], p[k]) for k in HIT_RATES if not bound(p[k], s[k])}
        assert not rates, f"step {s['step']}: hit rates (plain, pd) not {hit_rates}: {rates}"
        if transfers_every_step or set(p) - set(s):
            assert set(p) - set(s) == PD_KEYS
            assert p["rollout/pd_transfer_bytes"] > 0 and p["rollout/pd_transfer_s"] > 0
    assert any(PD_KEYS <= set(p) for p in pd)


def test_one_prefill_two_decode_replicas_is_the_run_without(ray_four, cache, tmp_path):
    plain = run_in_process(tmp_path / "plain", *TWO_REPLICAS)
    pd = run_in_process(tmp_path / "pd", *ONE_PREFILL_TWO_DECODE)
    # the prefill replica's forward holds both decode replicas' prompts, a larger batch than
    # each plain replica's, so float64 first-token log-probs may differ in their last bits
    assert_same_run(plain, pd, atol=1e-12)
    assert len({r["rollout/response_len_mean"] for r in plain}) > 1  # it samples and learns
    assert all(r["train/grad_norm"] > 0 for r in plain)


def test_colocated_pd_is_the_colocated_run_without(ray_four, cache, tmp_path):
    colocated = (
        "cluster.colocate=true",
        "cluster.devices=3",
        "cluster.rollout_devices=null",
        "rollout.prompts_per_step=6",  # 12 samples: 4 for each of the 3 trainer ranks
        "trainer.updates_per_rollout=1",
    )
    plain = run_in_process(tmp_path / "plain", *colocated)
    pd = run_in_process(tmp_path / "pd", *colocated, "rollout.prefill_replicas=1")
    assert_same_run(plain, pd, atol=1e-12)


def test_mixture_of_experts_routes_come_back_through_the_decode_replicas(ray_four, cache, tmp_path):
    rows = run_in_process(tmp_path / "pd_moe", *ONE_PREFILL_TWO_DECODE, *MOE, "steps=2")
    replayed_exactly(rows)


AGENT = str(Path(RECIPE).parent / "tiny_calc_agent_grpo.yaml")
AGENT_RUN = (
    "steps=2",
    "sft.steps=120",
    "sft.batch_size=32",
    "rollout.max_new_tokens=96",
    "rollout.kv_cache_tokens=8192",
    "model.dtype=float64",
    "reward.function=arith",
    "trainer.updates_per_rollout=1",
)


def test_multi_turn_sessions_in_pd_mode_are_the_run_without(ray_four, cache, tmp_path):
    plain = run_in_process(tmp_path / "plain", *AGENT_RUN, *TWO_REPLICAS, recipe=AGENT)
    pd = run_in_process(tmp_path / "pd", *AGENT_RUN, *ONE_PREFILL_TWO_DECODE, recipe=AGENT)
    # the same tokens; the decode replicas' batches differ from the plain run's in later turns,
    # so float64 log-probs (and what is computed from them) may differ in their last bits.
    # A later turn's new part is short: its decode replica prefills it itself, reusing the
    # session's earlier turns it holds, completions included, as the plain replica does: the
    # same hit rates
    assert_same_run(plain, pd, atol=1e-12, hit_rates="equal")
    assert max(r["rollout/turns_mean"] for r in plain) > 1  # later turns were served
    assert all(r["rollout/pd_local_prefills"] > 0 for r in pd)
    # every later turn through the prefill replica, which holds its session's earlier prompts
    # but not their completions (decoded elsewhere): it hits less than the plain replica
    every = run_in_process(
        tmp_path / "every",
        *AGENT_RUN,
        *ONE_PREFILL_TWO_DECODE,
        "rollout.pd_local_prefill_tokens=0",
        recipe=AGENT,
    )
    assert_same_run(plain, every, atol=1e-12, hit_rates="at_most")
    assert all(r["rollout/pd_local_prefills"] == 0 for r in every)
    later = "rollout/prefix_cache_hit_rate_turn2plus"
    assert any(r[later] < p[later] for r, p in zip(every, plain))
    for s, p, e in zip(plain, pd, every):  # for the report: the hit rates of the three runs
        print("hit rates (plain, pd, pd threshold 0):", [(s[k], p[k], e[k]) for k in HIT_RATES])


# over-sampled groups of varied lengths (`test_oversampling_e2e.OVER`): some are cut mid-sample
OVER = (
    "rollout.over_sampling=2",
    "rollout.max_new_tokens=40",
    "reward.function=user_rewards:brevity_score",
)


def assert_each_group_trained_once(rows: list[dict], n: int = 2) -> None:
    """Every step trains prompts_per_step whole groups; every fresh group launched is trained
    once, carried (then launched again, not drawn again) or still carried after the last step:
    none lost, none trained twice."""
    assert all(r["rollout/samples"] == 4 * n for r in rows)
    fresh = sum(r["rollout/launched_groups"] for r in rows) - sum(
        r["rollout/carried_groups"] for r in rows[:-1]
    )
    trained = sum(r["rollout/samples"] for r in rows) / n
    assert trained + rows[-1]["rollout/carried_groups"] == fresh


def test_streaming_scoring_in_pd_mode_is_the_run_without(ray_four, cache, tmp_path):
    """Each group scored as soon as its samples finish (the over-sampled rollout's path, every
    group in the quota): the decode replicas' streams hand on each finished request once."""
    plain = run_in_process(tmp_path / "plain", "rollout.stream_scoring=true", *TWO_REPLICAS)
    pd = run_in_process(tmp_path / "pd", "rollout.stream_scoring=true", *ONE_PREFILL_TWO_DECODE)
    assert_same_run(plain, pd, hit_rates="at_least")
    assert all(r["rollout/samples"] == 4 * 2 for r in pd)


def test_over_sampled_partial_rollouts_in_pd_mode_are_the_run_without(ray_four, cache, tmp_path):
    over = (*OVER, "rollout.partial=retract")
    plain = run_in_process(tmp_path / "plain", *over, *TWO_REPLICAS)
    pd = run_in_process(tmp_path / "pd", *over, *ONE_PREFILL_TWO_DECODE)
    assert_same_run(plain, pd, hit_rates="at_least")
    # partial samples were carried and continued under newer weights (prefilled again)
    assert any(r["rollout/carried_samples"] > 0 for r in plain)
    assert any(r["rollout/continued_groups"] > 0 for r in plain)
    assert any(r["rollout/staleness_max"] >= 1 for r in plain)
    assert_each_group_trained_once(plain)
    assert_each_group_trained_once(pd)


def test_over_sampled_in_place_partial_rollouts_in_pd_mode_are_the_run_without(
    ray_four, cache, tmp_path
):
    over = (*OVER, "rollout.partial=in_place", "steps=4")  # step 3 continues parked samples
    plain = run_in_process(tmp_path / "plain", *over, *TWO_REPLICAS)
    pd = run_in_process(tmp_path / "pd", *over, *ONE_PREFILL_TWO_DECODE)
    # continuations that adopt parked K/V compute on the decode replicas, outside the prefill
    # replica's cache counters: no bound between the two hit rates; their decode batches differ
    # from the plain run's, so float64 log-probs may differ in their last bits
    assert_same_run(plain, pd, atol=1e-12, hit_rates="any", transfers_every_step=False)
    # the same parked tokens were adopted (a key of both runs, compared above): the decode
    # replica holding a carried sample's K/V continued it, nothing was prefilled again
    assert any(r["rollout/in_place_reused_tokens"] > 0 for r in pd)
    assert any(r["rollout/continued_groups"] > 0 for r in pd)
    assert_each_group_trained_once(plain)
    assert_each_group_trained_once(pd)


def kill_prefill_then_decode(
    out: Path, known: set[str], done: threading.Event, monkeypatch
) -> list[str]:
    """engine 0 (the prefill replica) once the first step's row is logged; engine 1 (a decode
    replica) in a later step's rollout, right after a `decode` call is sent to it: the call is
    queued or running when the actor dies. (A probe of the actor cannot tell its decode from
    the weight push that follows a short rollout, and an engine dying during a push ends the
    run by design; so the decode kill rides on the call itself.)"""
    prefill, decode = new_actor(".engine.0", known), new_actor(".engine.1", known)
    metrics, killed, armed, seen = out / "metrics.jsonl", [], threading.Event(), 0
    send = PrefillDecode._wait

    async def wait_killing_decode(self, ref, actor: str, method: str):
        if armed.is_set() and (actor, method) == ("engine 1", "decode") and len(killed) == 1:
            ray.kill(decode)
            killed.append("decode")
        return await send(self, ref, actor, method)

    monkeypatch.setattr(PrefillDecode, "_wait", wait_killing_decode)
    while not done.is_set() and not armed.is_set():
        rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if rows == seen:
            time.sleep(0.005)
            continue
        seen = rows
        if not killed:
            ray.kill(prefill)
            killed.append("prefill")
        else:
            armed.set()
    done.wait()
    return killed


def test_a_killed_prefill_and_decode_replica_are_replaced(
    ray_four, cache, tmp_path, capsys, monkeypatch
):
    out, known, done = tmp_path / "run", set(ray.util.list_named_actors()), threading.Event()
    thread, killer = in_background(lambda: kill_prefill_then_decode(out, known, done, monkeypatch))
    try:
        overrides = [o for o in FEW_LONG_SAMPLES if not o.startswith("steps=")]
        rows = run_in_process(out, "steps=5", *overrides, *ONE_PREFILL_TWO_DECODE)
    finally:
        done.set()
        thread.join(timeout=30)
    assert killer.get("value") == ["prefill", "decode"], killer
    printed = capsys.readouterr().out
    # killed during its prefill call, or after it returned (then found idle at the rollout's end)
    assert re.search(
        r"engine 0 died \(during (prefill|node_id)\): killed by ray.kill; restarting", printed
    )
    assert "engine 1 died (during decode): killed by ray.kill; restarting it" in printed
    assert [r["step"] for r in rows] == list(range(5))
    assert sum(r["rollout/engine_restarts"] for r in rows) == 2
    for r in rows:  # nothing lost, nothing twice: every prompt's whole group, once
        assert r["rollout/samples"] == 2 * 2
