"""Over-sampled single-turn rollouts, partial carry-over and streaming scoring
(`rollout.over_sampling`, `rollout.partial`, `rollout.stream_scoring`).

A step launches ceil(prompts_per_step x over_sampling) groups: the groups carried over from the
previous step first (oldest first), then fresh prompts. Groups spread over the replicas in
contiguous shares (in_place: a carried group in the share of the replica holding its K/V;
prefill-decode: over the decode replicas; each share is prefilled on a prefill replica and
decoded on its own, `ReplicaBatcher.stream`); replica i must complete
quota_i groups (share i of prompts_per_step, split the same way) and its engine aborts the rest
at the step its quota is met (`AsyncEngine.submit_many(quota=)`). **The batch** is, on every
replica, the groups complete within its quota: carried groups already complete first (by group
index), then by the engine step that completed them (ties by group index); it is trained in
launch order. Nothing in it
depends on timing, so a resumed run (same carried groups, same data position, same seeds)
makes the same batch and cuts the same tokens.

Every group is scored as soon as its samples are all finished, on a thread of the rollout loop,
while the engines still generate the others (streaming; the same scores as scoring at the end).

The launched groups outside the batch (`rollout.partial`):

* abort: dropped and counted (`rollout/aborted_groups`). Their prompts count as consumed: the
  data source has moved past them and does not draw them again (as with a group dynamic
  sampling drops).
* retract: carried to the next step (`rollout/carried_groups`): finished samples as they are,
  unfinished ones with the tokens, engine log-probs and weight versions they have. The engine
  dropped their KV when it aborted them; the next step prefills prompt + tokens again under
  the new weights and samples on (seed from the new step), up to `rollout.max_new_tokens` in
  all (prefill-decode: prefilled again on a prefill replica and its K/V sent to the decode
  replica: the K/V the decode replica had was the old weights', which retract does not keep).
  So a trajectory's tokens may come from several weight versions, each token with the
  log-prob of the version that sampled it: the loss's importance correction (TIS / MIS) uses
  exactly those behaviour log-probs.
* in_place (disaggregated engines only): carried as with retract, but the engine keeps their
  K/V across the weight update instead of dropping it: their requests carry
  `SamplingParams.park_kv`, so an aborted sample's K/V is parked in the engine and the next
  step's continuation (prompt + tokens, the same request retract sends) goes to that replica
  (`homed_shares`; prefill-decode: to that decode replica directly, no prefill replica in
  between), which adopts it and computes only its pending token: the tokens before the update
  keep the K/V the old weights computed (as in AReaL), the new weights sample on. Parked K/V
  gives way to memory pressure, and is gone after an engine restart or a resume; that
  continuation then prefills, as retract does (`rollout/in_place_reused_tokens` counts the
  tokens that were not prefilled again).
  In the synchronous loop the carried requests wait parked while the trainer trains rather
  than decode on: how far they got would depend on timing, and the batch must not.

`rollout.max_carry_versions` bounds the carry-over: a group is carried across at most that
many weight updates (one a step: its oldest tokens are then that many versions old when it
continues); one that would be carried again is dropped and counted (`rollout/stale_dropped_
groups` / `_samples`).

Carried groups are part of a checkpoint (`partial.to_state` / `from_state`, in state.json).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from miles_like.rollouts.group_scoring import Group, GroupScorer
from miles_like.rollouts.partial import EMPTY, OpenGroup
from miles_like.rollouts.replica_batcher import Generation, ReplicaBatcher
from miles_like.shares import near_equal_shares


class Outcome(NamedTuple):
    """What one over-sampled rollout made."""

    batch: list[Group]  # in launch order
    carried: list[OpenGroup]  # to continue next step (retract)
    tallies: Counter
    metrics: dict[str, float]


def quotas(batch: int, shares: Sequence[range]) -> list[int]:
    """Replica i's quota: its contiguous share of `batch`, split as the groups are."""
    return [len(r) for r in near_equal_shares(batch, len(shares))]


def homed_shares(groups: Sequence[OpenGroup], parts: int) -> list[list[int]]:
    """`near_equal_shares`' sizes, but each carried group whose K/V a replica parked
    (`OpenGroup.replica`, `partial: in_place`) in that replica's share while it has room; the
    other groups fill the shares in order. Each share ascending (carried groups first)."""
    sizes = [len(r) for r in near_equal_shares(len(groups), parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    rest = []
    for g, group in enumerate(groups):
        home = group.replica
        if home is not None and home < parts and len(shares[home]) < sizes[home]:
            shares[home].append(g)
        else:
            rest.append(g)
    for share, size in zip(shares, sizes):
        while len(share) < size:
            share.append(rest.pop(0))
    return [sorted(share) for share in shares]


def launched(prompts_per_step: int, over_sampling: float) -> int:
    return math.ceil(prompts_per_step * over_sampling - 1e-9)


class OverSampledRollout:
    """One step's over-sampled rollout on `engines`, run on the manager's loop (`run`)."""

    def __init__(
        self,
        recipe,
        engines: list,
        scorer: GroupScorer,
        groups: list[OpenGroup],
        params: list,
        batcher: ReplicaBatcher,
    ):
        self.recipe = recipe
        self.engines = engines
        self.scorer = scorer
        self.groups = groups  # carried first, then fresh
        self.params = params  # per group: the step's SamplingParams (base seed)
        self.batcher = batcher
        self.scored: dict[int, asyncio.Future] = {}
        self.tallies: Counter = Counter()

    # ------------------------------------------------------------------------------- requests
    def _requests(self, g: int) -> list[tuple[list[int], object, list[int]]]:
        """(prompt ids, params, sample indices) of group g's requests: one of n samples for a
        fresh group, one per unfinished sample (n = 1) for a carried one."""
        group, params = self.groups[g], self.params[g]
        if self.recipe.rollout.partial == "in_place":
            params = dataclasses.replace(params, park_kv=True)
        if not group.samples:
            return [(list(group.problem.prompt_ids), params, list(range(params.n)))]
        out = []
        for j, s in enumerate(group.samples):
            if s.done:
                continue
            p = dataclasses.replace(
                params,
                n=1,
                seed=params.seed + j,
                max_new_tokens=self.recipe.rollout.max_new_tokens - len(s.token_ids),
            )
            out.append((list(group.problem.prompt_ids) + list(s.token_ids), p, [j]))
        return out

    async def run(self) -> Outcome:
        r = self.recipe.rollout
        # the replicas that generate (prefill-decode: the decode replicas, engines[k:])
        replicas = range(r.prefill_replicas, len(self.engines))
        in_place = r.partial == "in_place"
        if in_place:  # a carried group continues where its K/V is parked
            shares = homed_shares(self.groups, len(replicas))
        else:
            shares = [list(share) for share in near_equal_shares(len(self.groups), len(replicas))]
        home = {g: position for position, share in enumerate(shares) for g in share}
        batch_ids: list[int] = []
        calls = []
        for i, share, quota in zip(replicas, shares, quotas(r.prompts_per_step, shares)):
            ready = [g for g in share if self.groups[g].done]
            for g in ready:
                self._score_soon(g)
            batch_ids += ready[:quota]
            if quota > len(ready):
                rest = [g for g in share if g not in ready]
                calls.append(self._replica(i, rest, quota - len(ready)))
        for complete in await asyncio.gather(*calls):
            batch_ids += complete
        if self.batcher.failure is not None:
            raise self.batcher.failure
        if self.batcher.pd is not None:  # counted in this rollout's engine_restarts
            await self.batcher.pd.replace_dead_prefill_replicas()
        batch_ids.sort()
        chosen = set(batch_ids)
        batch = []
        for g in batch_ids:
            group, counts = await self.scored[g]
            batch.append(group)
            self.tallies.update(counts)
        rest = [g for g in range(len(self.groups)) if g not in chosen]
        keep = r.partial in ("retract", "in_place")
        carried = [
            self.groups[g]._replace(
                rollouts=self.groups[g].rollouts + 1,
                replica=home[g] if in_place and self._parked_on_replica(g) else None,
            )
            for g in rest
        ]
        stale = []
        if r.max_carry_versions is not None:  # rollouts, this one counted = updates crossed
            stale = [g for g in carried if g.rollouts > r.max_carry_versions]
            carried = [g for g in carried if g.rollouts <= r.max_carry_versions]
        self.tallies.update(self.batcher.tallies)
        metrics = self._metrics(batch_ids, rest, keep) if r.over_sampling > 1 else {}
        if keep and r.max_carry_versions is not None:
            metrics["stale_dropped_groups"] = float(len(stale))
            metrics["stale_dropped_samples"] = float(
                sum(not s.done for g in stale for s in g.samples)
            )
            metrics["carried_groups"] -= len(stale)
            metrics["carried_samples"] -= metrics["stale_dropped_samples"]
        if r.partial == "in_place":
            metrics["in_place_reused_tokens"] = float(self.tallies["parked_reused_tokens"])
        return Outcome(batch, carried if keep else [], self.tallies, metrics)

    def _parked_on_replica(self, g: int) -> bool:
        """Group g has a sample cut mid-way (in_place: its replica parked that K/V)."""
        return any(s.token_ids and not s.done for s in self.groups[g].samples)

    async def _replica(self, i: int, ids: list[int], quota: int) -> list[int]:
        prompts, params, groups, owners, direct = [], [], [], [], []
        # in_place, prefill-decode: a carried group's continuation goes to its decode replica
        # directly, not through a prefill replica: the replica adopts the K/V it parked (nothing
        # re-sent), or computes what it lacks, as one engine doing both would
        in_place = self.recipe.rollout.partial == "in_place"
        for g in ids:
            for prompt, p, js in self._requests(g):
                prompts.append(prompt)
                params.append(p)
                groups.append(g)
                owners.append((g, js))
                direct.append(in_place and bool(self.groups[g].samples))

        def on_result(k: int, samples: list[Generation]) -> None:
            g, js = owners[k]
            group = self.groups[g]
            now = list(group.samples) or [EMPTY] * len(js)
            for j, s in zip(js, samples):
                now[j] = now[j].extended(s)
            self.groups[g] = group._replace(samples=tuple(now))
            if self.groups[g].done:
                self._score_soon(g)

        return await self.batcher.stream(i, prompts, params, groups, quota, on_result, direct)

    # -------------------------------------------------------------------------------- scoring
    def _score_soon(self, g: int) -> None:
        loop = asyncio.get_running_loop()
        self.scored[g] = loop.run_in_executor(None, self.scorer.open_group, self.groups[g])

    # -------------------------------------------------------------------------------- metrics
    def _metrics(self, batch_ids: list[int], rest: list[int], keep: bool) -> dict[str, float]:
        """Staleness in weight versions over the batch's tokens (the newest version this
        rollout saw minus the version that sampled the token), and the carry-over counts."""
        versions = [v for g in batch_ids for s in self.groups[g].samples for v in s.versions]
        newest = max(versions, default=0)
        lag = [newest - v for v in versions]
        unfinished = sum(not s.done for g in rest for s in self.groups[g].samples)
        return {
            "staleness_mean": sum(lag) / max(len(lag), 1),
            "staleness_max": float(max(lag, default=0)),
            "launched_groups": float(len(self.groups)),
            "continued_groups": float(sum(self.groups[g].rollouts > 0 for g in batch_ids)),
            "carried_groups": float(len(rest) if keep else 0),
            "carried_samples": float(unfinished if keep else 0),
            "aborted_groups": float(0 if keep else len(rest)),
            "aborted_samples": float(0 if keep else unfinished),
        }
