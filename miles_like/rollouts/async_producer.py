"""The rollout side of fully asynchronous training (`cluster.fully_async`): a producer that
keeps the engines generating into a bounded buffer while the trainer trains.

Groups are drawn from the prompt source in data order; group g is the g-th prompt the run drew
(its *index*, the data position). Its first request is one request of n samples seeded exactly
as the synchronous loop seeds that data position (step g // prompts_per_step, place g %
prompts_per_step), so what an engine is asked to do for a prompt does not depend on the mode.

* **Capacity** (`cluster.async_buffer_groups`, B): groups open (generating or waiting to be
  sent), complete in the buffer, and taken by the trainer until their weight update, together
  never exceed B; the producer draws new prompts only below it (back-pressure). A taken batch
  frees its room only once the weights it trained are in the engines, so with B =
  prompts_per_step x (K + 1) at most K batches' worth is generated under older weights.
* **Sending**: newly drawn groups (and, after an update, the continued ones, index order) leave
  as one `EngineWorker.generate_wave` per replica, in contiguous shares, admitted together.
* **The buffer** holds complete groups in completion order (the order their last sample came
  back); each is scored as it completes (streaming), on an executor thread of the manager's
  loop. `take` gives the trainer the first prompts_per_step groups of the buffer that are not
  stale, trained in index order. Completion order depends on timing: an async run is not
  bitwise reproducible, except at max_staleness 0, where one batch is generated at a time.
* **A weight update** (`pause`, then the controller syncs, then `resume`): every running
  request is aborted (`close(abort_running=True)`) and comes back with the tokens it has; with
  `rollout.partial: retract` (or null) its group continues after the update, each unfinished
  sample as a request of its prompt + tokens so far (prefilled again under the new weights, its
  own seed, the remaining `max_new_tokens`); with `abort` its unfinished groups are dropped.
  Every token keeps the weight version that sampled it and its log-prob (`oversampling.Partial`),
  which the loss's TIS / MIS correction uses as the behaviour policy.
* **With `rollout.partial: in_place`** an update aborts nothing: the engines park their step
  loops between two forward passes for it (`Runtime.sync_weights(in_place=True)`), running
  requests keep their K/V and sample on with the new weights, and each returned sample carries
  its per-token versions (`GenerationResult.sample_versions`). Requests in flight are tracked
  per group (`_Slot.pending`, `sent_version`); the staleness check of an update aborts the
  requests sent more than max_staleness versions ago (`EngineWorker.cancel_wave`; their K/V is
  parked: requests carry `park_kv`) and, once they are back, drops the group if its tokens are
  too old or continues it on the parked K/V. Before a checkpoint the update is the retract one
  (every running request aborted, K/V parked), so that `state` holds every token.
* **Staleness** of a group trained at trainer version v: v minus the oldest version of any of
  its tokens. A group staler than `cluster.max_staleness` can never be trained: it is dropped
  (buffered ones when `take` reaches them, open ones at the update that makes them stale) and
  counted; its prompt is consumed and never drawn again (the data source has moved past it).

* **An engine that dies** (its wave fails, or a call on every replica finds it gone) is
  replaced at the controller's next producer call, at the engines' weight version
  (`Runtime.restart_engine`, within `cluster.max_engine_restarts`); its groups keep what they
  had delivered and are sent again (`_replace_dead`).

* **Dynamic sampling** (`algorithm.dynamic_sampling`): a buffered group is filtered as soon as
  it is scored when its rewards are all equal (no gradient): not trained, its room drawn again,
  its index reported by the next take (`Taken.filtered`); at most dynamic_sampling_max_rounds x
  prompts_per_step per batch, then groups are trained as they are. `take` chooses among the
  scored groups only.
* **Multi-turn rollout functions**: each open group is a task running the function
  (`async_agents.py`), its engine calls continued from their tokens over an update.

Accounting: every drawn index is exactly one of trained, dropped (stale or aborted), filtered
(dynamic sampling), or held (open, buffered, being trained, or filtered and not yet reported);
`held_indices` with the trained / dropped / filtered ids of the rows makes that checkable.
`state` (taken between `pause` and `resume`, when no request runs) holds the open groups with
their tokens, log-probs and versions, and the buffer, for the checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import random
import time
from collections import Counter
from typing import NamedTuple

import torch

from miles_like.errors import RolloutFailed
from miles_like.rollouts import agents as async_agents
from miles_like.rollouts.agents import AgentGroup
from miles_like.rollouts.oversampling import EMPTY, OpenGroup, from_state, score_group, to_state
from miles_like.rollouts.replica_batcher import Generation
from miles_like.run.calls import ActorDied, is_death
from miles_like.run.workers import CLOSED
from miles_like.scoring.shaping import informative_groups


@dataclasses.dataclass
class _Slot:
    """An open group (owned by the manager's loop)."""

    index: int
    group: OpenGroup
    pending: int = 0  # its requests sent and not yet back
    sent_version: int = 0  # the weights when they were sent: none of their tokens is older
    wave: tuple[int, int, list[int]] | None = None  # (replica, wave id, request indices)

    @property
    def running(self) -> bool:
        return self.pending > 0

    def oldest(self) -> int | None:
        """The oldest version of the tokens that came back (running ones are not counted)."""
        return min((v for s in self.group.samples for v in s.versions), default=None)


ENGINE_COUNTERS = (
    "generated_tokens",
    "prefill_tokens_computed",
    "prefix_cache_hit_tokens",
    "parked_reused_tokens",  # in_place: continuations that adopted parked K/V
    "in_place_kept_tokens",  # in_place: running requests' K/V kept across an update
)


class _Done(NamedTuple):
    index: int
    group: OpenGroup  # an agent group's: its problem and rollouts, no samples
    scored: asyncio.Future  # -> (rollout_manager.Group, reward failure counts)
    oldest: int | None  # the oldest weight version of its tokens
    trajectories: list | None = None  # an agent group's (what a checkpoint saves)


class Taken(NamedTuple):
    """One batch for the trainer."""

    groups: list  # rollout_manager.Group, in index order
    indices: list[int]
    staleness: list[int]  # per group, in versions
    continued: int  # groups of the batch that were continued over a weight update
    tallies: Counter  # reward failure counts
    seconds: float  # since the previous take (the window of the engine counters)
    engine: Counter  # the engines' counter deltas over that window
    buffered: int  # complete groups left in the buffer
    filtered: list[int] | None  # dynamic sampling: groups filtered since the previous take


class AsyncProducer:
    """Runs on `manager`'s asyncio loop; the controller calls the blocking methods."""

    def __init__(self, manager, capacity: int, max_staleness: int):
        self.m = manager
        self.recipe = manager.recipe
        self.capacity, self.max_staleness = capacity, max_staleness
        self.keep_partial = manager.recipe.rollout.partial != "abort"
        self.in_place = manager.recipe.rollout.partial == "in_place"
        self.version = 0  # the engines' weights (what the controller last synced)
        self.window_open = False
        self._wave_ids = 0
        self.slots: dict[int, _Slot] = {}
        self.done: list[_Done] = []
        # the indices of each batch taken by the trainer whose weight update is not in yet
        # (two while `take_ahead`'s batch waits for the step being trained)
        self.taken: list[list[int]] = []
        self.dropped: list[int] = []  # stale since the last `drops`
        self.aborted: list[int] = []  # unfinished at an update with rollout.partial: abort
        alg = manager.recipe.algorithm
        self.dynamic = alg.dynamic_sampling
        # dynamic sampling: groups filtered since the last take (reported by the next one), at
        # most this many per batch; past it, groups are trained as they are
        self.filtered: list[int] = []
        self.filter_budget = (
            alg.dynamic_sampling_max_rounds * manager.recipe.rollout.prompts_per_step
        )
        # a multi-turn rollout function: each group is a task running it (`async_agents.py`)
        self.agent_mode = manager.recipe.rollout.function != "single_turn"
        self.agents: dict[int, AgentGroup] = {}
        self._wake: asyncio.Event | None = None  # agents' engine calls wait for work accepted
        self.accepting = False
        self.failure: BaseException | None = None
        self._waves: set[asyncio.Task] = set()
        self._changed: asyncio.Event | None = None
        self._seeds: dict[int, list] = {}
        self._stats: list[dict] = []
        self._stats_at = 0.0
        self.timeout = manager.recipe.cluster.call_timeout_s
        self.version = 0  # the engines' weight version (what a replacement starts at)
        self.dead: dict[int, ActorDied] = {}  # replicas found dead, not yet replaced
        self._inbox: queue.SimpleQueue | None = None  # the current `_run`'s restart requests

    # ------------------------------------------------------------------ controller thread API
    def _run(self, coro):
        """`coro` on the manager's loop while this (the controller's) thread waits, replacing
        the engines `coro` finds dead (`_replace_dead`) here, as the synchronous loop does
        (`RolloutManager._wait`): no trainer call runs meanwhile, so the weights a replacement
        takes from the trainer are those of the engines' version (at `pause`, already the next
        one, which the update then gives it with its number, before it generates)."""
        from miles_like.rollouts.manager import _settle

        inbox = self._inbox = queue.SimpleQueue()
        future = asyncio.run_coroutine_threadsafe(coro, self.m._loop)
        future.add_done_callback(lambda _: inbox.put(None))
        while (msg := inbox.get()) is not None:
            i, died, done = msg
            try:
                self._restart(i, died)
            except BaseException as e:
                self.m._loop.call_soon_threadsafe(_settle, done, e)
                raise
            self.m._loop.call_soon_threadsafe(_settle, done, None)
        return future.result()

    def _restart(self, i: int, died: ActorDied) -> None:
        waiting = sum(not s.running for s in self.slots.values())
        self.m.restart_engine(i, died)
        self.m.log(
            f"{died}; replaced it at weight version {self.version}: the {waiting} open groups "
            f"waiting continue from the tokens they had ({self.m.source.consumed} prompts drawn)"
        )

    def start(self, version: int, state: dict | None = None) -> None:
        """Open the engines and begin producing (from a checkpoint's `state`, if given)."""
        self.version = version
        self._run(self._start(version, state))

    def take(self, count: int, version: int) -> Taken:
        self.version = version
        return self._run(self._take(count, version))

    def take_ahead(self, count: int, version: int, training) -> Taken | None:
        """The next step's batch, for trainer version `version` (the one the step being trained
        will produce), taken while `training` (an ObjectRef: that step's train call) runs, so
        that the next train call can start right after the weight update. None, and nothing
        taken, once `training` is done first, or when an engine is dead (its replacement takes
        the trainer's weights: it waits for the update, after the train call). The engines stay
        at their version; a group staler than max_staleness at `version` is dropped, as
        `take` at `version` would drop it."""
        return self._run(self._take(count, version, training))

    def pause(self, abort: bool = True) -> None:
        """Stop sending; with `abort`, abort every running request and wait until all of them
        are back (without, `rollout.partial: in_place`, they keep running through the update)."""
        self._run(self._pause(abort))

    def drop_stale(self, version: int) -> None:
        """After the update to `version`: free the trained batch's room, drop the open groups
        that can no longer be trained (and, with partial: abort, the unfinished ones)."""
        self.version = version
        self._run(self._drop_stale(version))

    def resume(self) -> None:
        """Reopen the engines, draw prompts up to the capacity and send what waits."""
        self._run(self._resume())

    def state(self) -> dict:
        return self._run(self._state())

    def drops(self) -> tuple[list[int], list[int], list[int]]:
        """(stale, aborted) indices dropped since the last call, and the held ones (open,
        buffered) at the same moment: with in_place, a group may be dropped at any time."""
        return self._run(self._drops())

    def held_indices(self) -> list[int]:
        return self._run(self._held_indices())

    # -------------------------------------------------------------------------- on the loop
    async def _start(self, version: int, state: dict | None) -> None:
        self._changed, self._wake = asyncio.Event(), asyncio.Event()
        self.version = version
        if state is not None:
            for row in state["open"]:
                (group,) = from_state([row])
                if self.agent_mode:  # restarts from its prompt (`async_agents.py`)
                    self.agents[row["index"]] = self._agent(row["index"], group.problem)
                else:
                    self.slots[row["index"]] = _Slot(row["index"], group)
            for row in state["buffer"]:
                (group,) = from_state([row])
                if "trajectories" in row:
                    trajectories = [
                        async_agents.trajectory_from_state(t) for t in row["trajectories"]
                    ]
                    self._complete_agent(row["index"], group, trajectories, {}, row["oldest"])
                else:
                    self._complete(row["index"], group)
            if self.agents:
                self.m.log(
                    f"resume: the {len(self.agents)} agent groups running at the checkpoint "
                    "restart from their prompts"
                )
            self.filtered = list(state.get("dynamic_filtered", []))
        self._stats = await self._engines("stats")
        self._stats_at = time.perf_counter()
        await self._resume()

    # ------------------------------------------------------------------------ engine deaths
    # A replica that dies (found by its wave or by a call on every replica) is replaced by the
    # controller's thread at its next producer call (`_run`); meanwhile its groups wait, with
    # the tokens, log-probs and versions they had delivered (whatever it was computing is lost:
    # retract), and are sent again once it is back, to whichever replicas `_fill` gives them.
    # A death is a handle's: a late failure of the replaced actor's calls is not the new one's.
    def _mark_dead(self, i: int, handle, method: str, error: BaseException) -> None:
        if self.m.engines[i] is handle:
            self.dead.setdefault(i, ActorDied(f"engine {i}", method, error))

    async def _replace_dead(self) -> None:
        while self.dead:
            i = min(self.dead)
            if self.m.restart_engine is None:
                raise self.dead[i]
            done = asyncio.get_running_loop().create_future()
            self._inbox.put((i, self.dead[i], done))
            await done
            del self.dead[i]
            engine = self.m.engines[i]
            try:  # its counters start again: the window's deltas count from here
                stats = await self._call(engine.stats.remote())
                if self._stats:
                    self._stats[i] = stats
                if self.accepting:
                    await self._call(engine.open.remote())
            except Exception as e:
                if not is_death(e):
                    raise
                self._mark_dead(i, engine, "stats", e)
        self._fill()

    async def _call(self, ref):
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout)

    async def _engines(self, method: str, *args, replace: bool = True) -> list | None:
        """`method` on every replica; one found dead is replaced and every replica asked again
        (the calls made this way are idempotent: open, close, stats). With `replace` false,
        None once a replica is found dead (the next call with `replace` replaces it)."""
        while True:
            if self.dead and not replace:
                return None
            await self._replace_dead()
            handles = list(self.m.engines)
            results = await asyncio.gather(
                *(self._call(getattr(e, method).remote(*args)) for e in handles),
                return_exceptions=True,
            )
            for i, (handle, r) in enumerate(zip(handles, results)):
                if isinstance(r, BaseException):
                    if not is_death(r):
                        raise r
                    self._mark_dead(i, handle, method, r)
            if not self.dead:
                return results

    async def _resume(self) -> None:
        if not self.window_open:  # in_place updates leave it open: no round trip
            await self._engines("open")
            self.window_open = True
        elif self.dead:  # found dead by the update's staleness check (`cancel_wave`)
            await self._replace_dead()
        self.accepting = True
        self._fill()

    def _fill(self) -> None:
        """Draw prompts up to the capacity, then send every open group not running."""
        if not self.accepting:
            return
        room = self.capacity - len(self.slots) - len(self.agents) - len(self.done)
        room -= sum(map(len, self.taken))
        if room > 0:
            start = self.m.source.consumed
            for k, problem in enumerate(self.m.source.next_batch(room)):
                if self.agent_mode:
                    self.agents[start + k] = self._agent(start + k, problem)
                else:
                    self.slots[start + k] = _Slot(start + k, OpenGroup(problem, ()))
        if self.agent_mode:
            self._start_agents()
            return
        waiting = sorted(i for i, s in self.slots.items() if not s.running)
        if not waiting:
            return
        from miles_like.rollouts.manager import _split

        for replica, share in enumerate(_split(len(waiting), len(self.m.engines))):
            if share:
                ids = [waiting[k] for k in share]
                # marked running now, not when the task starts: a second _fill before then
                # (a delivery, a replacement) must not send them again
                requests = self._begin_wave(replica, ids)
                task = asyncio.get_running_loop().create_task(self._wave(replica, ids, *requests))
                self._waves.add(task)
                task.add_done_callback(self._waves.discard)

    # ------------------------------------------------------------------------- agent groups
    def _agent(self, index: int, problem) -> AgentGroup:
        """Group `index`, on its replica: its place in its batch's contiguous shares."""
        from miles_like.rollouts.manager import _split

        per_step = self.recipe.rollout.prompts_per_step
        shares = _split(per_step, len(self.m.engines))
        replica = next(i for i, share in enumerate(shares) if index % per_step in share)
        return AgentGroup(index, problem, replica)

    def _start_agents(self) -> None:
        """Start the groups not running yet (index order) and wake the calls waiting."""
        loop = asyncio.get_running_loop()
        for i in sorted(self.agents):
            group = self.agents[i]
            if group.task is None:
                group.task = loop.create_task(async_agents.run_group(self, group))
        self._wake.set()

    async def agent_wave(self, replica: int, requests: list) -> list:
        """One agent call's requests (input ids, params, sample indices) as a wave on
        `replica`, once work is accepted and the replica is alive: what came back (aborted
        requests with the tokens they have); nothing when the window was closed or the replica
        died (the call sends its requests again). A non-death failure raises."""
        while not self.accepting or replica in self.dead:
            if self.failure is not None:
                raise self.failure
            self._wake.clear()
            await self._wake.wait()
        task = asyncio.get_running_loop().create_task(self._agent_wave(replica, requests))
        self._waves.add(task)
        task.add_done_callback(self._waves.discard)
        got = await task
        if self.failure is not None:
            raise self.failure
        return got

    async def _agent_wave(self, replica: int, requests: list) -> list:
        self._wave_ids += 1
        got = []
        try:
            prompts, params = [r[0] for r in requests], [r[1] for r in requests]
            await self._stream_wave(replica, prompts, params, self._wave_ids, got.append)
        finally:
            self._changed.set()
        return got

    async def _stream_wave(self, replica: int, prompts, params, wave: int, on_item) -> None:
        """Send one wave to `replica` and pass what it streams back, item by item, to
        `on_item` until the engine closes the window. A death marks the replica dead; any
        other failure (the engine's or `on_item`'s) is kept for `take` to raise. Either ends
        the wave; the caller's bookkeeping sends again what did not come back."""
        engine = self.m.engines[replica]
        try:
            gen = engine.generate_wave.remote(prompts, params, wave)
            while True:
                try:
                    ref = await asyncio.wait_for(gen.__anext__(), self.timeout)
                except StopAsyncIteration:
                    break
                item = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout)
                if item == CLOSED:
                    break
                on_item(item)
        except Exception as e:  # noqa: BLE001 -- raised to the controller by `take`
            if is_death(e):
                self._mark_dead(replica, engine, "generate_wave", e)
            else:
                self.failure = self.failure or RolloutFailed(
                    f"engine {replica}: generate_wave failed: {type(e).__name__}: {e}"
                )

    def agent_finished(self, group: AgentGroup, trajectories: list, tallies) -> None:
        del self.agents[group.index]
        problem = OpenGroup(group.problem, (), group.rollouts)
        self._complete_agent(group.index, problem, trajectories, tallies, group.oldest)

    def _complete_agent(self, index: int, group: OpenGroup, trajectories, tallies, oldest):
        loop = asyncio.get_running_loop()
        scored = loop.run_in_executor(
            None, async_agents.score_trajectories, self.m, group.problem, trajectories, tallies
        )
        self._buffer(_Done(index, group, scored, oldest, trajectories))

    def _first_params(self, index: int):
        """The synchronous loop's SamplingParams of data position `index`."""
        per_step = self.recipe.rollout.prompts_per_step
        step = index // per_step
        if step not in self._seeds:
            self._seeds = {step: self.m._params(step, 0, per_step)}
        return self._seeds[step][index % per_step]

    def _requests(self, slot: _Slot) -> list[tuple[list[int], object, list[int]]]:
        """(prompt ids, params, sample indices): one request of n samples for a fresh group,
        one per unfinished sample for a continued one (its own seed per continuation)."""
        group, base = slot.group, self._first_params(slot.index)
        if self.in_place:  # K/V an abort leaves (a checkpoint, a staleness check) is parked
            base = dataclasses.replace(base, park_kv=True)
        prompt = list(group.problem.prompt_ids)
        if not group.samples:
            return [(prompt, base, list(range(base.n)))]
        out = []
        for j, s in enumerate(group.samples):
            if s.done:
                continue
            rng = random.Random(f"{self.recipe.seed}/async/{slot.index}/{j}/{len(s.token_ids)}")
            p = dataclasses.replace(
                base,
                n=1,
                seed=rng.getrandbits(62),
                max_new_tokens=self.recipe.rollout.max_new_tokens - len(s.token_ids),
            )
            out.append((prompt + list(s.token_ids), p, [j]))
        return out

    def _begin_wave(self, replica: int, ids: list[int]) -> tuple[int, list, list, list]:
        """A new wave of groups `ids` to `replica`: its id and its requests (prompts, params,
        owners); the groups are marked as sent in it."""
        prompts, params, owners = [], [], []
        self._wave_ids += 1
        wave = self._wave_ids
        for i in ids:
            slot = self.slots[i]
            ks = []
            for prompt, p, js in self._requests(slot):
                ks.append(len(prompts))
                prompts.append(prompt)
                params.append(p)
                owners.append((i, js))
            slot.pending, slot.sent_version, slot.wave = len(ks), self.version, (replica, wave, ks)
        return wave, prompts, params, owners

    async def _wave(self, replica: int, ids: list[int], wave: int, prompts, params, owners) -> None:
        def deliver(item) -> None:
            k, samples, version, versions = item
            self._deliver(owners[k], samples, version, versions)

        try:
            await self._stream_wave(replica, prompts, params, wave, deliver)
        finally:
            for i in ids:  # a closed window or a failure: what did not come back waits
                slot = self.slots.get(i)
                if slot is not None and slot.wave is not None and slot.wave[1] == wave:
                    slot.pending, slot.wave = 0, None
            self._changed.set()

    def _deliver(self, owner: tuple[int, list[int]], samples, version: int, versions) -> None:
        i, js = owner
        slot = self.slots.get(i)
        if slot is None:  # dropped as stale while its requests ran (in_place)
            return
        now = list(slot.group.samples) or [EMPTY] * len(js)
        for k, (j, s) in enumerate(zip(js, samples)):
            per_token = tuple(versions[k]) if k < len(versions) else ()
            g = Generation(list(s.token_ids), list(s.logprobs), s.finish_reason, version, per_token)
            now[j] = now[j].extended(g)
        slot.group = slot.group._replace(samples=tuple(now))
        slot.pending -= 1
        if slot.group.done:
            del self.slots[i]
            self._complete(i, slot.group)
        elif not slot.running:
            slot.wave = None
            if self.in_place:  # back from an abort: a staleness check or a checkpoint
                if self._staleness(slot.group, self.version) > self.max_staleness:
                    self.dropped.append(i)
                    del self.slots[i]
                self._fill()  # continued (adopting the K/V it parked), or its room is free

    def _complete(self, index: int, group: OpenGroup) -> None:
        loop = asyncio.get_running_loop()
        scored = loop.run_in_executor(None, score_group, self.m, group)
        oldest = min((v for s in group.samples for v in s.versions), default=None)
        self._buffer(_Done(index, group, scored, oldest))

    def _buffer(self, done: _Done) -> None:
        self.done.append(done)
        if self.dynamic:  # filtered as soon as it is scored: its room is free at once
            done.scored.add_done_callback(lambda _: self._filter())
        self._changed.set()

    @staticmethod
    def _scored(d: _Done) -> bool:
        return d.scored.done() and not d.scored.cancelled() and d.scored.exception() is None

    def _filter(self) -> None:
        """Dynamic sampling: buffered groups scored with all rewards equal (no gradient) are
        not trained, counted in `filtered` (within the batch's budget), and their room is drawn
        again. A scoring failure stays in the buffer for `take` to raise."""
        keep = []
        for d in self.done:
            if (
                len(self.filtered) < self.filter_budget
                and self._scored(d)
                and not bool(informative_groups(torch.tensor([d.scored.result()[0].rewards]))[0])
            ):
                self.filtered.append(d.index)
            else:
                keep.append(d)
        if len(keep) < len(self.done):
            self.done = keep
            self._fill()
        self._changed.set()

    def _ready(self) -> list[_Done]:
        """The buffered groups `take` may choose: with dynamic sampling, the scored ones (the
        filter has seen them)."""
        return [d for d in self.done if d.scored.done()] if self.dynamic else self.done

    def _staleness(self, group: OpenGroup, version: int) -> int:
        oldest = min((v for s in group.samples for v in s.versions), default=version)
        return version - oldest

    @staticmethod
    def _lag(oldest: int | None, version: int) -> int:
        return 0 if oldest is None else version - oldest

    async def _take(self, count: int, version: int, training=None) -> Taken | None:
        ahead = training is not None  # `take_ahead`: give up rather than wait or replace
        trained = asyncio.wrap_future(training.future()) if ahead else None
        if ahead:  # its result (or error) is the controller's, read by `finish_train`
            trained.add_done_callback(lambda f: f.cancelled() or f.exception())
        while True:
            if self.failure is not None:
                raise self.failure
            if self.dead:
                if ahead:
                    return None
                await self._replace_dead()
            stale = {
                d.index for d in self.done if self._lag(d.oldest, version) > self.max_staleness
            }
            if stale:
                self.dropped += sorted(stale)
                self.done = [d for d in self.done if d.index not in stale]
                self._fill()  # their room is free
            if self.dynamic:
                self._filter()
            ready = self._ready()
            if len(ready) >= count:
                break
            if ahead and trained.done():
                return None
            idle = not self._waves and not self.agents
            if idle and len(ready) == len(self.done):  # nothing can complete one
                raise RolloutFailed(
                    f"async rollouts: {len(self.done)} of {count} groups complete and nothing "
                    "generating (a producer bug)"
                )
            self._changed.clear()
            changed = asyncio.ensure_future(self._changed.wait())
            await asyncio.wait(
                [changed, trained] if ahead else [changed], return_when=asyncio.FIRST_COMPLETED
            )
            changed.cancel()
        stats = await self._engines("stats", replace=not ahead)
        if stats is None:
            return None
        now = time.perf_counter()
        # after the await: the buffer only grew meanwhile, so the first `count` ready are still
        chosen = sorted(self._ready()[:count], key=lambda d: d.index)
        taken_ids = {d.index for d in chosen}
        self.done = [d for d in self.done if d.index not in taken_ids]
        self.taken.append([d.index for d in chosen])
        filtered, self.filtered = (sorted(self.filtered), []) if self.dynamic else (None, [])
        tallies: Counter = Counter()
        groups = []
        for d in chosen:
            group, counts = await d.scored
            groups.append(group)
            tallies.update(counts)
        engine: Counter = Counter()
        for before, after in zip(self._stats, stats):
            for key in ENGINE_COUNTERS:
                engine[key] += after[key] - before[key]
        seconds, self._stats, self._stats_at = now - self._stats_at, stats, now
        return Taken(
            groups,
            [d.index for d in chosen],
            [self._lag(d.oldest, version) for d in chosen],
            sum(d.group.rollouts > 0 for d in chosen),
            tallies,
            seconds,
            engine,
            len(self.done),
            filtered,
        )

    async def _pause(self, abort: bool) -> None:
        self.accepting = False
        self._wake.clear()
        if not abort:  # in_place: requests run on through the update, which must reach every
            await self._replace_dead()  # replica (a dead one is replaced first)
            return
        while True:  # until every replica is closed and alive: the update reaches them all
            await self._engines("close", True)
            self.window_open = False
            if self._waves:
                await asyncio.wait_for(asyncio.gather(*self._waves), self.timeout)
            if not self.dead:
                return

    async def _drop_stale(self, version: int) -> None:
        """Open groups whose returned tokens are too old are dropped. With in_place, requests
        still running across the update may hold such tokens too: those sent more than
        max_staleness versions ago are aborted (their tokens come back, parked K/V kept), and
        `_deliver` drops the group if its tokens really are too old, else continues it."""
        if self.taken:  # the trained batch's room is free
            self.taken.pop(0)
        self.version = version
        check: dict[tuple[int, int], list[int]] = {}  # (replica, wave) -> requests to abort
        for i in sorted(self.slots):
            slot = self.slots[i]
            oldest = slot.oldest()
            if oldest is not None and version - oldest > self.max_staleness:
                self.dropped.append(i)
                del self.slots[i]
                if slot.wave is not None:
                    check.setdefault(slot.wave[:2], []).extend(slot.wave[2])
            elif not self.keep_partial and slot.group.samples:
                self.aborted.append(i)
                del self.slots[i]
            else:
                if slot.running and version - slot.sent_version > self.max_staleness:
                    check.setdefault(slot.wave[:2], []).extend(slot.wave[2])
                if slot.group.samples or slot.running:  # continued across this update
                    slot.group = slot.group._replace(rollouts=slot.group.rollouts + 1)
        for i in sorted(self.agents):  # agent groups: no call runs (retract aborted them)
            group = self.agents[i]
            if group.oldest is not None and version - group.oldest > self.max_staleness:
                self.dropped.append(i)
            elif not self.keep_partial and group.oldest is not None:
                self.aborted.append(i)
            else:
                group.rollouts += group.oldest is not None
                continue
            del self.agents[i]
            if group.task is not None:
                group.task.cancel()
        if check:  # a replica that dies meanwhile is replaced at the next call (`_resume`)
            calls = [
                (replica, self.m.engines[replica], wave, ks)
                for (replica, wave), ks in check.items()
            ]
            results = await asyncio.gather(
                *(self._call(engine.cancel_wave.remote(wave, ks)) for _, engine, wave, ks in calls),
                return_exceptions=True,
            )
            for (replica, engine, _, _), r in zip(calls, results):
                if isinstance(r, BaseException):
                    if not is_death(r):
                        raise r
                    self._mark_dead(replica, engine, "cancel_wave", r)

    async def _state(self) -> dict:
        """JSON-ready: the open groups (index order) and the buffer (completion order)."""
        assert not self.taken, "a checkpoint with a batch taken ahead would not hold it"
        ids = sorted(self.slots)
        open_rows = to_state([self.slots[i].group for i in ids])
        buffer_rows = to_state([d.group for d in self.done])
        agents = sorted(self.agents)  # restart from their prompts (`async_agents.py`)
        open_rows += to_state([OpenGroup(self.agents[i].problem, ()) for i in agents])
        for d, row in zip(self.done, buffer_rows):
            if d.trajectories is not None:
                row["trajectories"] = [async_agents.trajectory_to_state(t) for t in d.trajectories]
                row["oldest"] = d.oldest
        return {
            "open": [{**row, "index": i} for i, row in zip(ids + agents, open_rows)],
            "buffer": [{**row, "index": d.index} for d, row in zip(self.done, buffer_rows)],
            # filtered after this step's take: the next row reports them
            "dynamic_filtered": list(self.filtered),
        }

    async def _drops(self) -> tuple[list[int], list[int], list[int]]:
        out = (sorted(self.dropped), sorted(self.aborted), await self._held_indices())
        self.dropped, self.aborted = [], []
        return out

    async def _held_indices(self) -> list[int]:
        """Open, buffered, taken ahead (after the update, `taken` holds only that one), or
        filtered since the last take (the next take reports them)."""
        ahead = [i for batch in self.taken for i in batch]
        held = [*self.slots, *self.agents, *(d.index for d in self.done), *self.filtered, *ahead]
        return sorted(held)


def batch_metrics(taken: Taken, stale: list[int], aborted: list[int], capacity: int) -> dict:
    """The async-only rollout/ keys of a step."""
    n = max(len(taken.staleness), 1)
    return {
        "staleness_mean": sum(taken.staleness) / n,
        "staleness_max": float(max(taken.staleness, default=0)),
        "continued_groups": float(taken.continued),
        "stale_dropped_groups": float(len(stale)),
        "aborted_groups": float(len(aborted)),
        "buffer_groups": float(taken.buffered),
        "buffer_fill": taken.buffered / capacity,
        "trained_prompt_ids": list(taken.indices),
        "stale_dropped_prompt_ids": stale,
        "aborted_prompt_ids": aborted,
        **(
            {}
            if taken.filtered is None
            else {  # the synchronous loop's dynamic-sampling keys, and the filtered indices
                "dynamic_dropped_groups": float(len(taken.filtered)),
                "dynamic_kept_groups": float(len(taken.indices)),
                "dynamic_filtered_prompt_ids": list(taken.filtered),
            }
        ),
    }
