"""Busy and idle accounting of an RL step: when did the engines and the trainer compute?

The actors record their own compute as wall-clock intervals (`time.time()`): every engine
forward pass (model forward + sampling, `rollout.activity`) with the sequences it computed and
the samples it finished, and every trainer call that computes (`TrainerWorker`: old / reference
log-probs, updates, critic). At the end of each step the controller drains both logs
(`take_activity` on every actor) and reads, over two windows:

* the rollout's window, from its launch to the end of its scoring (it may begin in the previous
  step): `engine_busy_frac` (mean over replicas, and `_min`) is the share of that window a
  replica spends in forward passes; `engine_occupancy` the time-weighted number of sequences a
  replica's passes compute over its peak in the window (mean over replicas); `rollout_tail_s`
  the time from the moment 90% of the window's samples were finished to the last one
  (`rollout_tail_frac`: its share of launch -> last sample);
* the step's window (its `perf/step_s`): `trainer_busy_frac`, the share a trainer rank spends
  computing (mean over ranks), and `device_idle_frac`, the share in which no engine and no
  trainer rank computes at all: sync, memory release / resume, scoring, Ray and controller
  overhead. Intervals recorded on several machines are comparable only with synchronized clocks.

`perf/idle_s` is a different, older number: the controller's overhead outside its timed phases.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from miles_like.run.calls import ActorDied, start_on_all, wait_all
from rollout.activity import ForwardPass

TAIL_SHARE = 0.9  # the tail starts when this share of the rollout's samples is finished


class Span(NamedTuple):
    start: float
    end: float


def union_seconds(spans: Iterable[Span], window: Span) -> float:
    """Length of the union of `spans` within `window`."""
    clipped = sorted(
        (max(s, window.start), min(e, window.end))
        for s, e in spans
        if min(e, window.end) > max(s, window.start)
    )
    total, cur_start, cur_end = 0.0, None, None
    for s, e in clipped:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def tail_seconds(completions: Sequence[float], share: float = TAIL_SHARE) -> float:
    """Time from the completion that brings the finished share to `share` to the last one."""
    if not completions:
        return 0.0
    times = sorted(completions)
    # the 1e-9 keeps share * n from rounding up past an integer (0.9 * 70 = 63.00000000000001)
    return times[-1] - times[max(0, math.ceil(share * len(times) - 1e-9) - 1)]


def occupancy(forwards: Sequence[ForwardPass]) -> float:
    """Time-weighted mean of the sequences per forward pass over their peak (0 without any)."""
    seconds = sum(f.end - f.start for f in forwards)
    if not forwards or seconds <= 0:
        return 0.0
    peak = max(f.sequences for f in forwards)
    return sum((f.end - f.start) * f.sequences for f in forwards) / seconds / peak


def completions(forwards: Iterable[ForwardPass], window: Span) -> list[float]:
    """When each sample of the window finished (a pass finishing k samples counts k times)."""
    return [
        f.end for f in forwards if window.start <= f.end <= window.end for _ in range(f.finished)
    ]


def rollout_metrics(per_engine: Sequence[Sequence[ForwardPass]], window: Span) -> dict[str, float]:
    length = max(window.end - window.start, 1e-9)
    inside = [[f for f in fs if f.end > window.start and f.start < window.end] for fs in per_engine]
    busy = [union_seconds((Span(f.start, f.end) for f in fs), window) / length for fs in inside]
    occupied = [occupancy(fs) for fs in inside if fs]
    done = completions((f for fs in per_engine for f in fs), window)
    tail = tail_seconds(done)
    return {
        "engine_busy_frac": sum(busy) / len(busy) if busy else 0.0,
        "engine_busy_frac_min": min(busy, default=0.0),
        "engine_occupancy": sum(occupied) / len(occupied) if occupied else 0.0,
        "rollout_tail_s": tail,
        "rollout_tail_frac": tail / max(max(done) - window.start, 1e-9) if done else 0.0,
    }


def step_metrics(
    per_engine: Sequence[Sequence[ForwardPass]], per_rank: Sequence[Sequence[Span]], window: Span
) -> dict[str, float]:
    length = max(window.end - window.start, 1e-9)
    ranks = [union_seconds(spans, window) / length for spans in per_rank]
    engines = (Span(f.start, f.end) for fs in per_engine for f in fs)
    anything = union_seconds([*engines, *(s for spans in per_rank for s in spans)], window)
    return {
        "trainer_busy_frac": sum(ranks) / len(ranks) if ranks else 0.0,
        "device_idle_frac": 1.0 - anything / length,
    }


class BusyAccounting:
    """The controller's side: drains the actors' logs every step and keeps what a later window
    still needs (the forwards of a rollout launched during this step)."""

    def __init__(self, actors):
        self.actors = actors  # the run's `RunActors`
        self.forwards: dict[int, list[ForwardPass]] = {}  # by engine index (replacements too)
        # time.time() of a perf_counter() reading: the rollout manager times with the latter
        self._wall_offset = time.time() - time.perf_counter()
        self._rollout: Span | None = None

    def rollout_finished(self, started_perf: float) -> None:
        """The step's rollout (launched at `started_perf`, a perf_counter()) is scored now."""
        self._rollout = Span(started_perf + self._wall_offset, time.time())

    def step_done(self, start: float, end: float, pending_started: float | None) -> dict:
        """perf/ metrics of the step in [start, end] (time.time()); `pending_started`: the
        perf_counter() launch of the rollout still running, if any."""
        actors = self.actors
        for i, c in enumerate(start_on_all("engine", actors.engines, "take_activity")):
            try:
                (forwards,) = wait_all([c], actors.timeout_s)
            except ActorDied:  # the rollout in flight replaces it (its passes are lost)
                forwards = []
            self.forwards.setdefault(i, []).extend(forwards)
        calls = start_on_all("trainer rank", actors.trainers, "take_activity")
        taken = wait_all(calls, actors.timeout_s)
        per_rank = [[Span(*s) for s in spans] for spans in taken]
        per_engine = [self.forwards[i] for i in sorted(self.forwards)]
        out = step_metrics(per_engine, per_rank, Span(start, end))
        if self._rollout is not None:
            out.update(rollout_metrics(per_engine, self._rollout))
        keep_from = end if pending_started is None else pending_started + self._wall_offset
        for i, forwards in self.forwards.items():
            self.forwards[i] = [f for f in forwards if f.end >= keep_from]
        self._rollout = None
        return {f"perf/{k}": v for k, v in out.items()}
