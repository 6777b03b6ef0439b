"""The producer's waves under prefill-decode disaggregation (`rollout.prefill_replicas: k`).

Waves go to the decode replicas (engines[k:]) only. A wave's requests that need their prompt
computed (fresh groups, and the continuations of requests a retract update aborted: prompt +
tokens so far) are prefilled on the prefill replica the cache-aware router picks, which samples
every sample's first token; the decode replica then adopts the handoffs' K/V and decodes on
(`EngineWorker.decode_wave`, streamed as `generate_wave`). The waves of one fill that picked the
same prefill replica are prefilled in one call (`EngineWorker.prefill` with `splits`: one
handoffs return per wave), as the synchronous path prefills a wave of decode replicas' batches:
one larger forward, and the prefix-cache counters of one replica prefilling the whole batch. An
in-place continuation whose K/V its decode replica parked (`OpenGroup.replica`) is sent to that
replica as prompt ids and computed there, adopting the parked K/V: nothing is re-sent.

Weight versions: a handoff carries the version that prefilled it and a decode replica at another
refuses it (`StaleHandoff`, an in-place update landing between the two calls): the refused
requests come back as not sent and are prefilled again, so nothing is served across a version
boundary. A retract update closes every replica, prefill ones included (`Replicas.on_every`), and
waits for every wave: a wave prefilled before it finds its decode replica closed and is sent
again after it.

Deaths: a prefill replica found dead (by its `prefill`, or by a decode replica finding the
handoffs' shared buffers gone with it) leaves the waves' groups waiting with the tokens they had;
it is replaced as a decode replica is (`Replicas.replace_dead`) and the groups prefilled again.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

from miles_like.errors import RolloutFailed
from miles_like.rollouts.prefill_then_decode import PD_COUNTERS
from miles_like.run.calls import is_death
from rollout.serving.router import Router


class PrefillWaves:
    """The prefill half of the waves of `replicas` (a `replacement.Replicas`: its engines,
    timeout, `call`, `failed` and `read_stream`), engines[:prefill_replicas] prefilling:
    `send` a fill's waves, each decoded by `decode`."""

    def __init__(self, replicas, prefill_replicas: int):
        self.replicas = replicas
        self.count = prefill_replicas
        self.router = Router(prefill_replicas)  # index i is engine i
        self.transfers: Counter = Counter()  # PD_COUNTERS since the last `take_transfers`
        self._nodes: dict[str, str] = {}  # engine actor id -> its node

    def take_transfers(self) -> Counter:
        """The transfers' counters since the previous call."""
        out, self.transfers = self.transfers, Counter()
        return out

    async def send(self, waves: list, run_wave: Callable[[int, object], Awaitable]) -> None:
        """Prefill the requests of `waves` (each `(decode replica, prompts, params, direct)`:
        request k of a wave is computed on its decode replica when k is in `direct`), then run
        `run_wave(j, handoffs)` for each wave j, concurrently: `handoffs` is `[ref]` of its
        handoffs (`[]`: nothing to prefill), None when a replica was found dead (nothing sent),
        or a RolloutFailed. A prefill call's shared buffers are freed once its waves are done."""
        todo = [[k for k in range(len(w[1])) if k not in w[3]] for w in waves]
        # every choice before the first await: the calls are fixed by the fill alone
        chosen = {
            j: self.router.start_batch([waves[j][1][k] for k in ks])
            for j, ks in enumerate(todo)
            if ks
        }
        try:
            calls: dict[tuple[int, bool], list[int]] = {}
            unsent = []
            for j, p in chosen.items():
                try:
                    share = await self._same_node(p, waves[j][0])
                except RolloutFailed as failure:
                    unsent.append(run_wave(j, failure))
                    continue
                if share is None:
                    unsent.append(run_wave(j, None))
                else:
                    calls.setdefault((p, share), []).append(j)
            await asyncio.gather(
                *unsent,
                *(run_wave(j, []) for j in range(len(waves)) if j not in chosen),
                *(
                    self._prefill_then(p, share, {j: todo[j] for j in js}, waves, run_wave)
                    for (p, share), js in calls.items()
                ),
            )
        finally:
            for p in chosen.values():
                self.router.finished(p)

    async def decode(
        self, d: int, handoffs: list, params: list, own: dict, wave: int, on_item
    ) -> tuple[RolloutFailed | None, bool]:
        """Decode replica d's wave (`decode_wave`) from `handoffs` (`[ref]` or `[]`) and its
        own requests `own` (index -> prompt ids), read into `on_item` (`Replicas.read_stream`).
        Returns (a failure for `take` to raise, or None; whether some request was refused or
        its handoffs gone: to be prefilled again now, not after an update)."""
        retry = False

        def on_decoded(item) -> None:
            nonlocal retry
            if isinstance(item, dict):  # the wave's last item
                retry = item.get("gone", False) or item["refused"] > 0
                self.transfers.update({k: item.get(k, 0) for k in PD_COUNTERS})
            else:
                on_item(item)

        engine = self.replicas.engines[d]
        failure = await self.replicas.read_stream(
            d,
            engine,
            "decode_wave",
            lambda: engine.decode_wave.remote(handoffs, params, own, wave),
            on_decoded,
        )
        return failure, retry

    async def _prefill_then(
        self, p: int, share: bool, todo: dict[int, list[int]], waves: list, run_wave
    ) -> None:
        """One `prefill` call on prefill replica p holding the requests `todo[j]` of each wave
        j, then those waves."""
        prompts = [waves[j][1][k] for j, ks in todo.items() for k in ks]
        params = [waves[j][2][k] for j, ks in todo.items() for k in ks]
        engine = self.replicas.engines[p]
        try:
            counters_ref, *handoffs = engine.prefill.options(num_returns=1 + len(todo)).remote(
                prompts, params, share, [len(ks) for ks in todo.values()]
            )
            counters = await self.replicas.call(counters_ref)
        except Exception as e:  # noqa: BLE001 -- a death marks it, any other is the waves'
            try:
                self._died(p, engine, "prefill", e)
                outcome = None
            except RolloutFailed as failure:
                outcome = failure
            await asyncio.gather(*(run_wave(j, outcome) for j in todo))
            return
        try:
            await asyncio.gather(*(run_wave(j, [ref]) for j, ref in zip(todo, handoffs)))
        finally:
            if counters["handoff_key"] is not None:  # best effort: it may have died meanwhile
                engine.release_handoffs.remote(counters["handoff_key"])

    async def _same_node(self, p: int, d: int) -> bool | None:
        """Whether engines p and d share a node (their handoffs go through shared buffers);
        None when one of them is found dead."""
        nodes = []
        for i in (p, d):
            engine = self.replicas.engines[i]
            key = engine._actor_id.hex()  # the handle names its actor
            if key not in self._nodes:
                try:
                    self._nodes[key] = await self.replicas.call(engine.node_id.remote())
                except Exception as e:  # noqa: BLE001 -- raised to the controller by `take`
                    self._died(i, engine, "node_id", e)
                    return None
            nodes.append(self._nodes[key])
        return nodes[0] == nodes[1]

    def _died(self, i: int, engine, method: str, error: BaseException) -> None:
        """`method` on engine i raised `error`: its death is marked; any other failure is
        raised as RolloutFailed."""
        if not is_death(error):
            raise RolloutFailed(
                f"engine {i}: {method} failed: {type(error).__name__}: {error}"
            ) from error
        self.replicas.failed(i, engine, method, error)
