"""A `ReplicaBatcher` call under prefill-decode disaggregation (`rollout.prefill_replicas: k`).

The replicas split in two roles: engines[:k] only prefill, the others decode. A batch queued on
decode replica d (its groups' home: a session's later turns stay on the replica holding its
earlier ones) is prefilled on the prefill replica the cache-aware router picks (longest prefix
it was sent, then load: `rollout.serving.router`), which samples every sample's first token and
holds the handoffs; d then fetches them, copies their K/V into its own pages and decodes on
(`run.engine_pd`). The prefill replica is free for the next batch as soon as its call returns,
so a handoff's transfer and decode overlap the next prefill.

The batches of a wave (the decode replicas' queues that left together, `ReplicaBatcher`) that
picked the same prefill replica are prefilled in one call, their handoffs returned per decode
replica, as a PD prefill server batches every decode server's requests: one larger forward
instead of several, and the prefix-cache counters of one replica prefilling its whole batch.
The over-sampled `stream` stays one prefill call per decode replica: the over-sampled rollout
calls it for each replica's share on its own (no queue forms a wave), so under prefill-decode its
prefix-cache counters are those of one prefill call per decode replica.

Conditional disaggregation (`split_local`, `rollout.pd_local_prefill_tokens`): a later turn of a
session goes to its decode replica as a plain `generate` when the part of it not in that
replica's prefix cache is short. The decode replica decoded the earlier turns, so it holds
their K/V whole, completions included, where a prefill replica holds only the earlier prompts:
sent there, every later turn would compute most of its context again. First turns always go
through a prefill replica. The split depends only on the caches' contents, so a run repeats.

The two calls together return what one `generate` on one engine returns (same seeds, same
tokens: `rollout.prefill_decode`), with the prefill's prefix-cache counters, and the transfer's
bytes and seconds (`PD_COUNTERS`). A handoff carries its weight version and a decode replica at
another refuses it, so nothing is served across a weight update.

Deaths: a prefill replica that dies is replaced and the whole call prefilled again there; a
decode replica that dies is replaced and the same handoffs decoded there (the prefill replica
holds them until every decode replica of the call has returned); a decode replica's handoffs
whose buffers died with their prefill replica (`HandoffGone`) are prefilled again, its batch
alone. Each replacement is counted as any engine's (`rollout/engine_restarts`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from miles_like.run.calls import Call, CallTimeout
from miles_like.run.handoff_transport import HandoffGone
from rollout.serving.router import Router

# summed over a step's calls; the step's metrics are per request (`rollout_metrics`)
PD_COUNTERS = ("pd_transfer_bytes", "pd_transfer_s", "pd_requests")
PREFILL_COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")


class PrefillDecode:
    """The prefill-then-decode calls of one `ReplicaBatcher` (its engines, timeout and
    `with_replacement`; not imported: it imports this): engines[:prefill_replicas] prefill."""

    def __init__(self, batcher, prefill_replicas: int, local_prefill_tokens: int = 0):
        self.batcher = batcher
        self.local_prefill_tokens = local_prefill_tokens  # `split_local`; 0: none local
        self.router = Router(prefill_replicas)  # over engines[:k]: index i is engine i
        self._nodes: dict[str, str] = {}  # engine actor id -> its node

    async def generate(
        self,
        batches: dict[int, tuple[list[list[int]], list]],
        on_prefilled: Callable[[dict], None],
        on_decoded: Callable[[int, list, dict], None],
    ) -> None:
        """`generate(prompts, params)` of every decode replica d's batch `batches[d]`, a wave
        that left together: each batch goes to the prefill replica the router picks for it, and
        the batches that picked the same one (and the same transport) are prefilled in one
        call, their handoffs split per decode replica; then each decode replica decodes its
        own, concurrently. `on_prefilled(counters)` once per prefill call (its prefix-cache
        counters), before its batches are decoded; `on_decoded(d, samples, counters)` as d's
        decode returns: samples per prompt, and the transfer's counters with the
        `weight_version` that sampled them."""
        # every choice before the first await: the wave's calls are fixed by the queues alone
        chosen = {d: self.router.start_batch(prompts) for d, (prompts, _) in batches.items()}
        try:
            calls: dict[tuple[int, bool], list[int]] = {}
            for d, p in chosen.items():
                share = await self._node(p) == await self._node(d)
                calls.setdefault((p, share), []).append(d)
            await all_of(
                self._prefill_then_decode(
                    p, share, {d: batches[d] for d in ds}, on_prefilled, on_decoded
                )
                for (p, share), ds in calls.items()
            )
        finally:
            for p in chosen.values():
                self.router.finished(p)

    async def split_local(self, parts: dict[int, list]) -> tuple[dict[int, list], dict[int, list]]:
        """Later turns: (local, remote) of every decode replica d's requests `parts[d]` (each
        with its `prompt_ids`). Local are those whose part not in d's prefix cache is at most
        `local_prefill_tokens` (`EngineWorker.cached_prefix_lengths`, read without changing the
        cache): d prefills them itself (a plain `generate`), reusing the K/V of the session's
        earlier turns it holds, completions included, which a prefill replica never saw (sent
        there, a later turn computes its context again). The others go through a prefill
        replica. Decided by the caches' contents alone, which the previous calls fixed: the
        same run, the same split. With `local_prefill_tokens` 0 none is (d is not asked)."""
        if not self.local_prefill_tokens:
            return {}, parts
        ds = list(parts)
        cached = await asyncio.gather(
            *(self._cached_prefix_lengths(d, [r.prompt_ids for r in parts[d]]) for d in ds)
        )
        local: dict[int, list] = {}
        remote: dict[int, list] = {}
        for d, lengths in zip(ds, cached):
            for r, n in zip(parts[d], lengths):
                short = len(r.prompt_ids) - n <= self.local_prefill_tokens
                (local if short else remote).setdefault(d, []).append(r)
        return local, remote

    async def _cached_prefix_lengths(self, d: int, prompts: list[list[int]]) -> list[int]:
        b = self.batcher

        async def attempt():
            ref = b.engines[d].cached_prefix_lengths.remote(prompts)
            return await self._wait(ref, f"engine {d}", "cached_prefix_lengths")

        return await b.with_replacement(d, "cached_prefix_lengths", 0, attempt)

    async def _prefill_then_decode(
        self, p: int, share: bool, batches: dict, on_prefilled, on_decoded
    ) -> None:
        """One `prefill` call on prefill replica p holding every batch of `batches`, then their
        decodes; its shared buffers are freed once every decode has returned."""
        prompts = [prompt for batch, _ in batches.values() for prompt in batch]
        params = [param for _, batch in batches.values() for param in batch]
        splits = [len(batch) for batch, _ in batches.values()]
        counters, handoffs, prefiller = await self._prefill(p, prompts, params, share, splits)
        try:
            on_prefilled(counters)
            await all_of(
                self._decode_batch(d, p, share, refs, *batches[d], on_decoded)
                for d, refs in zip(batches, handoffs)
            )
        finally:
            self._release(prefiller, counters["handoff_key"])

    async def _decode_batch(
        self, d: int, p: int, share: bool, handoffs, prompts, params, on_decoded
    ) -> None:
        """Decode replica d's batch from `handoffs` (a ref of its handoffs); if they died with
        their prefill replica (`HandoffGone`), the batch is prefilled again on p alone (its
        counters not tallied again: its prompts were counted by the call that lost them)."""
        own = None  # (prefiller, handoff_key) of a prefill of this batch alone
        try:
            while True:
                try:
                    samples, decoded = await self._decode(d, handoffs, params)
                    break
                except HandoffGone:  # its prefill replica died meanwhile: prefill again
                    if own is not None:
                        self._release(*own)
                    counters, (handoffs,), prefiller = await self._prefill(
                        p, prompts, params, share, [len(prompts)]
                    )
                    own = (prefiller, counters["handoff_key"])
        finally:
            if own is not None:
                self._release(*own)
        on_decoded(
            d,
            samples,
            {**{k: decoded[k] for k in PD_COUNTERS}, "weight_version": decoded["weight_version"]},
        )

    @staticmethod
    def _release(prefiller, key: int | None) -> None:
        if key is not None:  # best effort: it may have died
            prefiller.release_handoffs.remote(key)

    async def stream(
        self, d: int, prompts, params, groups, quota, consume, direct: list[bool] | None = None
    ) -> dict:
        """An over-sampled rollout's `generate_stream` on decode replica d, in two calls: the
        prompts prefilled on a prefill replica, then decode replica d's `decode_stream` (the
        same groups and quota: it aborts the rest once `quota` groups are complete) read by
        `consume(stream, method)`, which hands each finished request on once. Counters as
        `generate_stream`'s, with the prefill's cache counters and the transfer's.

        The requests flagged in `direct` (in-place continuations: their K/V is parked on d) go
        to d as they are, not through a prefill replica: d adopts its parked K/V and computes
        only what is missing, so nothing is re-sent."""
        direct = direct or [False] * len(prompts)
        own = {i: prompts[i] for i, flag in enumerate(direct) if flag}
        to_prefill = [i for i, flag in enumerate(direct) if not flag]
        if not to_prefill:
            return await self._decode_own(d, params, groups, quota, consume, own)
        prompts_p, params_p = [prompts[i] for i in to_prefill], [params[i] for i in to_prefill]
        p = self.router.start_batch(prompts_p)
        try:
            share = await self._node(p) == await self._node(d)
            while True:
                counters, (handoffs,), prefiller = await self._prefill(
                    p, prompts_p, params_p, share, [len(prompts_p)]
                )

                async def attempt(handoffs=handoffs):
                    gen = self.batcher.engines[d].decode_stream.remote(
                        [handoffs], params, groups, quota, own
                    )
                    return await consume(gen, "decode_stream")

                try:
                    decoded = await self.batcher.with_replacement(
                        d, "decode_stream", len(params), attempt
                    )
                except HandoffGone:  # its prefill replica died meanwhile: prefill again
                    continue
                finally:
                    self._release(prefiller, counters["handoff_key"])
                break
        finally:
            self.router.finished(p)
        return {**{k: counters[k] for k in PREFILL_COUNTERS}, **decoded}

    async def _decode_own(self, d: int, params, groups, quota, consume, own: dict) -> dict:
        """`stream` when every request is d's own (nothing prefilled elsewhere)."""

        async def attempt():
            gen = self.batcher.engines[d].decode_stream.remote([], params, groups, quota, own)
            return await consume(gen, "decode_stream")

        decoded = await self.batcher.with_replacement(d, "decode_stream", len(params), attempt)
        return {**dict.fromkeys(PREFILL_COUNTERS, 0), **decoded}

    async def replace_dead_prefill_replicas(self) -> None:
        """Once a rollout's requests are done: each prefill replica answers a call (its node), a
        dead one is replaced now. A prefill replica idles once its prefill calls returned, so a
        death after them would be found only by the weight push, where no replacement is made
        (the run stops without a checkpoint); during the rollout it is an engine death as any."""
        b = self.batcher
        for p in range(self.router.num_replicas):

            async def attempt(p=p):
                return await self._wait(b.engines[p].node_id.remote(), f"engine {p}", "node_id")

            await b.with_replacement(p, "node_id", 0, attempt)

    async def _prefill(self, p: int, prompts, params, share: bool, splits: list[int]):
        """One `prefill` call on replica p (again on its replacement if it dies): its counters,
        one handoffs ref per split, and the engine that holds them."""
        b = self.batcher

        async def attempt():
            engine = b.engines[p]
            counters_ref, *handoffs = engine.prefill.options(num_returns=1 + len(splits)).remote(
                prompts, params, share, splits
            )
            counters = await self._wait(counters_ref, f"engine {p}", "prefill")
            return counters, handoffs, engine

        return await b.with_replacement(p, "prefill", len(prompts), attempt)

    async def _decode(self, d: int, handoffs_ref, params):
        b = self.batcher

        async def attempt():
            ref = b.engines[d].decode.remote([handoffs_ref], params)
            return await self._wait(ref, f"engine {d}", "decode")

        return await b.with_replacement(d, "decode", len(params), attempt)

    async def _node(self, i: int) -> str:
        """Engine i's node (asked once per actor; a replacement keeps its bundles' node)."""
        b = self.batcher
        engine = b.engines[i]
        key = engine._actor_id.hex()  # the handle names its actor
        if key not in self._nodes:

            async def attempt():
                return await self._wait(b.engines[i].node_id.remote(), f"engine {i}", "node_id")

            self._nodes[key] = await b.with_replacement(i, "node_id", 0, attempt)
        return self._nodes[key]

    async def _wait(self, ref, actor: str, method: str):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.batcher.timeout_s)
        except TimeoutError:
            raise CallTimeout([Call(actor, method, ref)], self.batcher.timeout_s) from None


async def all_of(calls: Iterable[Awaitable]) -> None:
    """Await every call concurrently; the first failure is raised and the others cancelled."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a no-op once done
