"""The buffer of complete groups, and the trainer's take.

Complete groups wait in completion order (the order their last sample came back); each is
scored as it completes (streaming), on an executor thread of the rollout loop. `take` gives the
trainer the first prompts_per_step groups of the buffer that are not stale, trained in index
order. Staleness of a group trained at trainer version v: v minus the oldest version of any of
its tokens; a buffered group staler than `cluster.max_staleness` can never be trained and is
dropped when `take` reaches it (its room is drawn again).

Dynamic sampling (`algorithm.dynamic_sampling`): a buffered group is filtered as soon as it is
scored when its rewards are all equal (no gradient): not trained, its room drawn again, its
index reported by the next take (`AsyncBatch.filtered`); at most dynamic_sampling_max_rounds x
prompts_per_step per batch, then groups are trained as they are. `take` chooses among the
scored groups only.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from miles_like.errors import RolloutFailed
from miles_like.rollouts.async_producer.ledger import AsyncBatch, BufferedGroup, Flow, Ledger
from miles_like.rollouts.async_producer.replacement import Replicas
from miles_like.rollouts.group_scoring import GroupScorer, informative
from miles_like.rollouts.partial import OpenGroup

ENGINE_COUNTERS = (
    "generated_tokens",
    "prefill_tokens_computed",
    "prefix_cache_hit_tokens",
    "parked_reused_tokens",  # in_place: continuations that adopted parked K/V
    "in_place_kept_tokens",  # in_place: running requests' K/V kept across an update
)
# prefill-decode: the prompts' counters are the prefill replicas' (a decode replica adopting a
# handoff shares its prompt with the samples' forks again), as the synchronous path counts them
PREFILL_COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")


class Buffer:
    """Complete groups until the trainer takes them. `refill()` draws into room it frees."""

    def __init__(
        self,
        recipe,
        scorer: GroupScorer,
        ledger: Ledger,
        flow: Flow,
        replicas: Replicas,
        max_staleness: int,
        refill: Callable[[], None],
    ):
        self.scorer = scorer
        self.ledger, self.flow, self.replicas = ledger, flow, replicas
        self.max_staleness = max_staleness
        self.refill = refill
        alg = recipe.algorithm
        self.dynamic = alg.dynamic_sampling
        # groups filtered per batch at most; past it, groups are trained as they are
        self.filter_budget = alg.dynamic_sampling_max_rounds * recipe.rollout.prompts_per_step
        # the engines' counters at the previous take, and when (the window of the next)
        self._counters: list[dict] = []
        self._counters_at = 0.0

    # ------------------------------------------------------------------------- completion
    def complete(self, index: int, group: OpenGroup) -> None:
        """A single-turn group whose samples are all done: scored, then buffered."""
        scored = asyncio.get_running_loop().run_in_executor(None, self.scorer.open_group, group)
        self._add(BufferedGroup(index, group, scored, group.oldest()))

    def complete_agent(self, index: int, group: OpenGroup, trajectories, tallies, oldest):
        """A finished agent group (`group`: its problem and rollouts), scored, then buffered."""
        scored = asyncio.get_running_loop().run_in_executor(
            None, self.scorer.finished, group.problem, trajectories, tallies
        )
        self._add(BufferedGroup(index, group, scored, oldest, trajectories))

    def _add(self, done: BufferedGroup) -> None:
        self.ledger.buffered.append(done)
        if self.dynamic:  # filtered as soon as it is scored: its room is free at once
            done.scored.add_done_callback(lambda _: self.filter())
        self.flow.changed.set()

    # ------------------------------------------------------------------------------ choice
    @staticmethod
    def _scored(d: BufferedGroup) -> bool:
        return d.scored.done() and not d.scored.cancelled() and d.scored.exception() is None

    def filter(self) -> None:
        """Dynamic sampling: buffered groups scored with all rewards equal (no gradient) are
        not trained, counted in `filtered` (within the batch's budget), and their room is drawn
        again. A scoring failure stays in the buffer for `take` to raise."""
        ledger, keep = self.ledger, []
        for d in ledger.buffered:
            if (
                len(ledger.filtered) < self.filter_budget
                and self._scored(d)
                and not informative([d.scored.result()[0]])
            ):
                ledger.filtered.append(d.index)
            else:
                keep.append(d)
        if len(keep) < len(ledger.buffered):
            ledger.buffered = keep
            self.refill()
        self.flow.changed.set()

    def ready(self) -> list[BufferedGroup]:
        """The buffered groups `take` may choose: with dynamic sampling, the scored ones (the
        filter has seen them)."""
        buffered = self.ledger.buffered
        return [d for d in buffered if d.scored.done()] if self.dynamic else buffered

    def _drop_stale(self, version: int) -> None:
        stale = {d.index for d in self.ledger.buffered if d.lag(version) > self.max_staleness}
        if stale:
            self.ledger.dropped += sorted(stale)
            self.ledger.buffered = [d for d in self.ledger.buffered if d.index not in stale]
            self.refill()  # their room is free

    # ------------------------------------------------------------------- engine counters
    async def start_window(self) -> None:
        """The engines' counters now: the first batch's window starts here."""
        self._counters = await self.replicas.on_every("stats")
        self._counters_at = time.perf_counter()

    def engine_replaced(self, i: int, counters: dict) -> None:
        """A replacement's counters start again: the window's deltas count from here."""
        if self._counters:
            self._counters[i] = counters

    # -------------------------------------------------------------------------------- take
    async def take(self, count: int, version: int, training=None) -> AsyncBatch | None:
        """`count` groups for trainer `version`, once there are; with `training` (the train
        call's ObjectRef: `take_ahead`), None once it is done first or an engine is dead."""
        ahead = training is not None  # `take_ahead`: give up rather than wait or replace
        trained = asyncio.wrap_future(training.future()) if ahead else None
        if ahead:  # its result (or error) is the controller's, read by `finish_train`
            trained.add_done_callback(lambda f: f.cancelled() or f.exception())
        ledger, flow = self.ledger, self.flow
        while True:
            if flow.failure is not None:
                raise flow.failure
            if self.replicas.dead:
                if ahead:
                    return None
                await self.replicas.replace_dead()
            self._drop_stale(version)
            if self.dynamic:
                self.filter()
            ready = self.ready()
            if len(ready) >= count:
                break
            if ahead and trained.done():
                return None
            idle = not flow.waves and not ledger.agents
            if idle and len(ready) == len(ledger.buffered):  # nothing can complete one
                raise RolloutFailed(
                    f"async rollouts: {len(ledger.buffered)} of {count} groups complete and "
                    "nothing generating (a producer bug)"
                )
            flow.changed.clear()
            changed = asyncio.ensure_future(flow.changed.wait())
            await asyncio.wait(
                [changed, trained] if ahead else [changed], return_when=asyncio.FIRST_COMPLETED
            )
            changed.cancel()
        counters = await self.replicas.on_every("stats", replace=not ahead)
        if counters is None:
            return None
        now = time.perf_counter()
        # after the await: the buffer only grew meanwhile, so the first `count` ready are still
        chosen = sorted(self.ready()[:count], key=lambda d: d.index)
        taken_ids = {d.index for d in chosen}
        ledger.buffered = [d for d in ledger.buffered if d.index not in taken_ids]
        ledger.taken.append([d.index for d in chosen])
        filtered, ledger.filtered = (sorted(ledger.filtered), []) if self.dynamic else (None, [])
        tallies: Counter = Counter()
        groups = []
        for d in chosen:
            group, counts = await d.scored
            groups.append(group)
            tallies.update(counts)
        engine: Counter = Counter()
        prefill = self.replicas.prefill
        for i, (before, after) in enumerate(zip(self._counters, counters)):
            decoding = prefill is not None and i >= prefill.count
            for key in ENGINE_COUNTERS:
                if not (decoding and key in PREFILL_COUNTERS):
                    engine[key] += after[key] - before[key]
        if prefill is not None:  # the handoffs' transfers over the same window
            engine.update(prefill.take_transfers())
        seconds, self._counters, self._counters_at = now - self._counters_at, counters, now
        return AsyncBatch(
            groups,
            [d.index for d in chosen],
            [d.lag(version) for d in chosen],
            sum(d.group.rollouts > 0 for d in chosen),
            tallies,
            seconds,
            engine,
            len(ledger.buffered),
            filtered,
        )
