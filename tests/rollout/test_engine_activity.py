"""The engine's activity log (`rollout.activity`): what the busy / idle metrics are built from.

Every forward pass is logged with its interval inside the `generate` call, the intervals add up
to the engine's own `busy_s` counter, every finished sample is logged once, and a rollout whose
last sample is forced long has a tail at least as long as decoding its extra tokens alone takes
(timed independently, on a fresh engine, as the fastest of repeated single-sequence steps)."""

from __future__ import annotations

import time

import pytest

from miles_like.run.busy import Span, completions, rollout_metrics
from rollout import Engine, EngineConfig, SamplingParams
from rollout.activity import ActivityLog

SHORT, EXTRA = 2, 24


def engine_for(directory) -> Engine:
    return Engine(EngineConfig(model_path=str(directory), kv_cache_tokens=4096, seed=0))


def test_forwards_add_up_to_the_engine_counters(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen2")
    engine = engine_for(directory)
    assert engine.stats()["busy_s"] == 0.0
    engine.activity = ActivityLog()
    prompts = [[3, 5, 7, 9, 11][: 2 + k % 4] for k in range(9)] + [[2, 4, 6]]
    params = [SamplingParams(n=2, max_new_tokens=SHORT, ignore_eos=True, seed=k) for k in range(9)]
    params.append(SamplingParams(n=1, max_new_tokens=SHORT + EXTRA, ignore_eos=True, seed=99))
    t0 = time.time()
    outs = engine.generate(prompts, params)
    t1 = time.time()
    forwards = engine.activity.take()
    stats = engine.stats()
    assert len(forwards) == stats["forward_passes"] > EXTRA
    assert sum(f.end - f.start for f in forwards) == pytest.approx(stats["busy_s"], rel=1e-9)
    assert t0 <= forwards[0].start and forwards[-1].end <= t1
    assert all(a.end <= b.start for a, b in zip(forwards, forwards[1:]))  # one loop, in order
    assert sum(f.finished for f in forwards) == sum(len(o) for o in outs) == 19
    assert max(f.sequences for f in forwards) == 19 and forwards[-1].sequences == 1
    assert engine.activity.take() == []  # drained

    window = Span(t0, t1)
    m = rollout_metrics([forwards], window)
    assert m["engine_busy_frac"] == pytest.approx(stats["busy_s"] / (t1 - t0), rel=1e-9)
    assert 0.0 < m["engine_busy_frac"] <= 1.0 and 0.0 < m["engine_occupancy"] < 1.0
    # 18 short samples finish by the third pass (prefill + SHORT - 1 decodes): 90% of 19 is
    # reached then; the long one decodes EXTRA more tokens alone
    done = sorted(completions(forwards, window))
    assert done[-2] < forwards[-EXTRA].start and done[-1] == forwards[-1].end

    # the tail spans at least the EXTRA passes the long sample decoded alone (their recorded
    # spans, whose sum is the engine's busy_s above): a bound that holds however loaded the
    # machine is, unlike a solo run timed in another period
    assert m["rollout_tail_s"] >= forwards[-1].end - forwards[-EXTRA].start > 0
