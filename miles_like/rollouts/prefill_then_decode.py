"""A `ReplicaBatcher` call under prefill-decode disaggregation (`rollout.prefill_replicas: k`).

The replicas split in two roles: engines[:k] only prefill, the others decode. A batch queued on
decode replica d (its groups' home: a session's later turns stay on the replica holding its
earlier ones) is prefilled on the prefill replica the cache-aware router picks (longest prefix
it was sent, then load: `rollout.serving.router`), which samples every sample's first token and
holds the handoffs; d then fetches them, copies their K/V into its own pages and decodes on
(`run.engine_pd`). The prefill replica is free for the next batch as soon as its call returns,
so a handoff's transfer and decode overlap the next prefill.

The two calls together return what one `generate` on one engine returns (same seeds, same
tokens: `rollout.prefill_decode`), with the prefill's prefix-cache counters, and the transfer's
bytes and seconds (`PD_COUNTERS`). A handoff carries its weight version and a decode replica at
another refuses it, so nothing is served across a weight update.

Deaths: a prefill replica that dies is replaced and the batch prefilled again; a decode replica
that dies is replaced and the same handoffs decoded there (the prefill replica still holds
them); handoffs whose buffers died with their prefill replica (`HandoffGone`) are prefilled
again. Each replacement is counted as any engine's (`rollout/engine_restarts`).
"""

from __future__ import annotations

import asyncio

from miles_like.run.calls import Call, CallTimeout
from miles_like.run.handoff_transport import HandoffGone
from rollout.serving.router import Router

# summed over a step's calls; the step's metrics are per request (`rollout_metrics`)
PD_COUNTERS = ("pd_transfer_bytes", "pd_transfer_s", "pd_requests")
PREFILL_COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")


class PrefillDecode:
    """The prefill-then-decode calls of one `ReplicaBatcher` (its engines, timeout and
    `with_replacement`; not imported: it imports this): engines[:prefill_replicas] prefill."""

    def __init__(self, batcher, prefill_replicas: int):
        self.batcher = batcher
        self.router = Router(prefill_replicas)  # over engines[:k]: index i is engine i
        self._nodes: dict[str, str] = {}  # engine actor id -> its node

    async def generate(self, d: int, prompts: list[list[int]], params: list):
        """`generate(prompts, params)` served by a prefill replica and decode replica d:
        (samples per prompt, counters) as `EngineWorker.generate` returns them."""
        p = self._choose(prompts)
        try:
            share = await self._node(p) == await self._node(d)
            while True:
                counters, handoffs, prefiller = await self._prefill(p, prompts, params, share)
                try:
                    samples, decoded = await self._decode(d, handoffs, params)
                except HandoffGone:  # its prefill replica died meanwhile: prefill again
                    continue
                finally:
                    if counters["handoff_key"] is not None:  # best effort: it may have died
                        prefiller.release_handoffs.remote(counters["handoff_key"])
                break
        finally:
            self.router.finished(p)
        return samples, {
            **{k: counters[k] for k in PREFILL_COUNTERS},
            **{k: decoded[k] for k in PD_COUNTERS},
            "weight_version": decoded["weight_version"],
        }

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
        p = self._choose(prompts_p)
        try:
            share = await self._node(p) == await self._node(d)
            while True:
                counters, handoffs, prefiller = await self._prefill(p, prompts_p, params_p, share)

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
                    if counters["handoff_key"] is not None:  # best effort: it may have died
                        prefiller.release_handoffs.remote(counters["handoff_key"])
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

    def _choose(self, prompts: list[list[int]]) -> int:
        """The prefill replica for `prompts` (the router's choice for the first; it then
        remembers all of them there), counted as started."""
        p = self.router.choose(prompts[0])
        for prompt in prompts[1:]:
            self.router.record(p, prompt)
        self.router.started(p)
        return p

    async def _prefill(self, p: int, prompts, params, share: bool):
        b = self.batcher

        async def attempt():
            engine = b.engines[p]
            counters_ref, handoffs_ref = engine.prefill.remote(prompts, params, share)
            counters = await self._wait(counters_ref, f"engine {p}", "prefill")
            return counters, handoffs_ref, engine

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
