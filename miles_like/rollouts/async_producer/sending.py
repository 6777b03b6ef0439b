"""Drawing prompts up to the capacity and sending the open single-turn groups to the engines.

Groups are drawn in data order; group g (the g-th prompt the run drew) gets the sampling
parameters the synchronous loop gives that data position (`PositionParams`). The groups
waiting are sent as one `EngineWorker.generate_wave` per replica, in contiguous shares (index
order), admitted together; a wave's groups are marked sent when the wave is made, so no group
is ever in two waves. A fresh group is one request of n samples; a continued one (after an
abort) one request per unfinished sample, of its prompt + tokens so far, with a seed of its own
and the remaining `max_new_tokens`. What comes back is appended to the group's samples with
the version that sampled each token; a complete group goes to the buffer.

Under prefill-decode disaggregation (`rollout.prefill_replicas`) waves go to the decode replicas
only, each prefilled on a prefill replica first (`disaggregated.py`); with `partial: in_place` a
group cut mid-sample is sent back to the decode replica that parked its K/V while that replica's
share has room (`oversampling.homed_shares`, as the synchronous path), and computed there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from miles_like.rollouts.async_producer.buffer import Buffer
from miles_like.rollouts.async_producer.ledger import Flow, GroupInProgress, Ledger
from miles_like.rollouts.async_producer.replacement import Replicas
from miles_like.rollouts.oversampling import homed_shares
from miles_like.rollouts.partial import EMPTY, OpenGroup
from miles_like.rollouts.replica_batcher import Generation
from miles_like.shares import near_equal_shares


class PositionParams:
    """The synchronous loop's SamplingParams of data position `index`: sample `index %
    prompts_per_step` of step `index // prompts_per_step`'s draw (the last step's kept)."""

    def __init__(self, manager):
        self.manager = manager
        self.per_step = manager.recipe.rollout.prompts_per_step
        self._step: dict[int, list] = {}

    def __call__(self, index: int):
        step = index // self.per_step
        if step not in self._step:
            self._step = {step: self.manager.sampling_params(step, 0, self.per_step)}
        return self._step[step][index % self.per_step]


class Sender:
    """Fills the capacity and sends the waiting groups (`agents`: a multi-turn function's
    groups are drawn here and run as tasks instead)."""

    def __init__(
        self,
        manager,
        ledger: Ledger,
        flow: Flow,
        replicas: Replicas,
        buffer: Buffer,
        params: PositionParams,
        max_staleness: int,
        agents=None,
    ):
        self.source = manager.source
        self.recipe = manager.recipe
        self.ledger, self.flow, self.replicas, self.buffer = ledger, flow, replicas, buffer
        self.params = params
        self.agents = agents  # agents.AgentGroups, or None (single-turn)
        self.in_place = manager.recipe.rollout.partial == "in_place"
        self.max_staleness = max_staleness

    def fill(self) -> None:
        """Draw prompts up to the capacity, then send every open group not running."""
        if not self.flow.accepting:
            return
        room = self.ledger.room()
        if room > 0:
            start = self.source.consumed
            for k, problem in enumerate(self.source.next_batch(room)):
                if self.agents is not None:
                    self.ledger.agents[start + k] = self.agents.group(start + k, problem)
                else:
                    self.ledger.open[start + k] = GroupInProgress(start + k, OpenGroup(problem, ()))
        if self.agents is not None:
            self.agents.start()
            return
        waiting = self.waiting()
        if not waiting:
            return
        decoding = self.replicas.decoding
        if self.replicas.prefill is not None and self.in_place:  # parked K/V: home first
            shares = homed_shares([self.ledger.open[i].group for i in waiting], len(decoding))
        else:
            shares = near_equal_shares(len(waiting), len(decoding))
        # marked running now, not when the task starts: a second fill before then (a
        # delivery, a replacement) must not send them again
        waves = [
            (replica, *self._begin_wave(replica, [waiting[k] for k in share]))
            for replica, share in zip(decoding, shares)
            if share
        ]
        loop, pd = asyncio.get_running_loop(), self.replicas.prefill
        if pd is None:
            for wave in waves:
                self.flow.track(loop.create_task(self._wave(*wave)))
            return

        async def run_wave(j: int, handoffs) -> None:
            await self._wave(*waves[j], handoffs=handoffs)

        # prefill-decode: the fill's waves prefilled together, then each decoded
        requests = [(w[0], w[3], w[4], w[6]) for w in waves]  # replica, prompts, params, direct
        self.flow.track(loop.create_task(pd.send(requests, run_wave)))

    def waiting(self) -> list[int]:
        """The open groups to send (not running), in index order."""
        return sorted(i for i, g in self.ledger.open.items() if not g.running)

    def requests(self, slot: GroupInProgress) -> list[tuple[list[int], object, list[int]]]:
        """(prompt ids, params, sample indices): one request of n samples for a fresh group,
        one per unfinished sample for a continued one (its own seed per continuation)."""
        group, base = slot.group, self.params(slot.index)
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

    def _begin_wave(self, replica: int, ids: list[int]) -> tuple:
        """A new wave of groups `ids` to `replica`: (ids, its id, its requests: prompts,
        params, owners, and those computed on the replica itself: `direct`); the groups are
        marked as sent in it."""
        prompts, params, owners, direct = [], [], [], set()
        wave = self.replicas.next_wave_id()
        home = self._position(replica)
        for i in ids:
            slot = self.ledger.open[i]
            # in_place, prefill-decode: back to the decode replica that parked its K/V, which
            # adopts it (nothing re-sent); anywhere else it is prefilled again
            parked = self.replicas.prefill is not None and slot.group.replica == home
            ks = []
            for prompt, p, js in self.requests(slot):
                ks.append(len(prompts))
                if parked:
                    direct.add(len(prompts))
                prompts.append(prompt)
                params.append(p)
                owners.append((i, js))
            slot.pending, slot.sent_version = len(ks), self.flow.version
            slot.wave = (replica, wave, ks)
        return ids, wave, prompts, params, owners, direct

    def _position(self, replica: int) -> int:
        """`replica`'s position among the replicas waves go to (`OpenGroup.replica`)."""
        return replica - self.replicas.decoding.start

    async def _wave(
        self,
        replica: int,
        ids: list[int],
        wave: int,
        prompts,
        params,
        owners,
        direct,
        handoffs=None,
    ) -> None:
        """Wave `wave` on `replica`, what comes back delivered. Prefill-decode: `handoffs` as
        `PrefillWaves.send` gives them (`[ref]` or `[]`: decoded; None: not sent, a replica
        died; a RolloutFailed: not sent, raised by `take`)."""

        def deliver(item) -> None:
            k, samples, version, versions = item
            self.deliver(owners[k], samples, version, versions, replica)

        retry, pd = False, self.replicas.prefill
        try:
            if pd is None:
                failure = await self.replicas.stream_wave(replica, prompts, params, wave, deliver)
            elif isinstance(handoffs, list):
                own = {k: prompts[k] for k in direct}
                failure, retry = await pd.decode(replica, handoffs, params, own, wave, deliver)
            else:
                failure = handoffs
            self.flow.failure = self.flow.failure or failure
        finally:
            for i in ids:  # a closed window or a failure: what did not come back waits
                slot = self.ledger.open.get(i)
                if slot is not None and slot.wave is not None and slot.wave[1] == wave:
                    slot.pending, slot.wave = 0, None
            self.flow.changed.set()
        # prefill-decode: a handoff refused (an update landed between prefill and decode) or
        # gone (its prefill replica died: replaced first) is prefilled again
        if retry and self.flow.accepting and not self.replicas.dead:
            self.fill()

    def deliver(
        self, owner: tuple[int, list[int]], samples, version: int, versions, replica: int
    ) -> None:
        """Request `owner` (group index, its sample indices) came back from `replica`:
        `samples`, sampled by weight `version` (`versions`: per sample, per token, where an
        update landed)."""
        i, js = owner
        slot = self.ledger.open.get(i)
        if slot is None:  # dropped as stale while its requests ran (in_place)
            return
        now = list(slot.group.samples) or [EMPTY] * len(js)
        for k, (j, s) in enumerate(zip(js, samples)):
            per_token = tuple(versions[k]) if k < len(versions) else ()
            g = Generation(
                list(s.token_ids), list(s.logprobs), s.finish_reason, version, per_token, s.routes
            )
            now[j] = now[j].extended(g)
        slot.group = slot.group._replace(samples=tuple(now))
        slot.pending -= 1
        if slot.group.done:
            del self.ledger.open[i]
            self.buffer.complete(i, slot.group)
        elif not slot.running:
            slot.wave = None
            if self.in_place and self.replicas.prefill is not None:  # its K/V parked there
                slot.group = slot.group._replace(replica=self._position(replica))
            if self.in_place:  # back from an abort: a staleness check or a checkpoint
                oldest = slot.group.oldest()
                if oldest is not None and self.flow.version - oldest > self.max_staleness:
                    self.ledger.dropped.append(i)
                    del self.ledger.open[i]
                self.fill()  # continued (adopting the K/V it parked), or its room is free
