"""`EngineWorker`'s two roles under prefill-decode disaggregation (`rollout.prefill_replicas`):
a prefill replica's `prefill` and a decode replica's `decode`, together one `generate`
(`rollouts.replica_batcher` chains them). The handoffs between them travel as
`handoff_transport` says: shared buffers on one node, freed by `release_handoffs` once the
decode replica has copied them. A mixin of `EngineWorker` (it reads the worker's `engine`,
`async_engine`, `followers`, `handoff_sender`, `handoff_receiver` and `_waves`). `prefill_one`
serves the HTTP endpoints of the decode replicas (`engine_endpoint.RemotePrefill`);
`cached_prefix_lengths` tells the batch path which later turns a decode replica prefills
itself (`rollout.pd_local_prefill_tokens`); `decode_wave` the fully asynchronous producer's
waves on a decode replica.
"""

from __future__ import annotations

import itertools
import threading
import time

import ray

from miles_like.run.handoff_transport import HandoffGone, nbytes
from miles_like.run.routed_samples import finished_requests, routed_samples

CACHE_COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")
CLOSED = "closed"  # generate_wave / decode_wave: the window was closed, no request was admitted
# decode_wave's waves open their handoffs concurrently (the serve group); the opener is shared
_OPENING = threading.Lock()


def cache_counters(before: dict, after: dict, keys=CACHE_COUNTERS) -> dict[str, int]:
    """What happened to the engine's counters `keys` between two `stats()`."""
    return {k: after[k] - before[k] for k in keys}


class PrefillDecodeRoles:
    prefill_calls = 0  # `prefill` calls served (in the worker's `stats`)

    @ray.method(num_returns=2)
    def prefill(self, prompts: list[list[int]], params: list, share: bool, splits=None):
        """A prefill replica's part of `generate`: each prompt computed and its samples' first
        tokens sampled, all in one call. Returns first `generate`'s counters (plus
        `handoff_key`), so the caller can wait for them alone, then the handoffs: one return
        of them all, or with `splits` (request counts summing to `len(prompts)`: the batches of
        several decode replicas, called with `.options(num_returns=1 + len(splits))`) one
        return per batch, in order. Their tensors are in shared buffers when `share` (the
        decode replicas are on this node: `handoff_transport`; one `handoff_key` frees them
        all), else the handoffs themselves."""
        from rollout.async_engine import held_open

        self.prefill_calls += 1
        with held_open(self.async_engine):
            before = self.engine.stats()
            futures = self.async_engine.submit_prefill(list(zip(prompts, params)))
            handoffs = [self.followers.intact(f.result) for f in futures]
            after = self.engine.stats()
        key = None
        if share:
            key, handoffs = self.handoff_sender.share(handoffs)
        version = handoffs[0].weight_version if handoffs else after["weight_version"]
        counters = {**cache_counters(before, after), "weight_version": version, "handoff_key": key}
        if splits is None:
            return counters, handoffs
        if sum(splits) != len(handoffs):
            raise ValueError(f"prefill: splits {splits} do not sum to {len(handoffs)} prompts")
        ends = list(itertools.accumulate(splits))
        return (counters, *(handoffs[end - n : end] for n, end in zip(splits, ends)))

    @ray.method(concurrency_group="handoff")
    def release_handoffs(self, key: int) -> None:
        """Free the shared buffers of `prefill` call `key` (its decode replica has them)."""
        self.handoff_sender.release(key)

    def decode(self, handoffs: list, params: list) -> tuple[list, dict]:
        """A decode replica's part of `generate`: `handoffs` is `[ref]` of a prefill's handoffs
        (a list, so Ray leaves fetching them to this method, which times it); they are decoded
        with `params` (those they were prefilled with). Returns `generate`'s samples, and the
        transfer's `pd_transfer_bytes`, `pd_transfer_s` (fetch and copy into this device) and
        `pd_requests`, plus the `weight_version` that sampled them. A handoff prefilled at
        another weight version is refused (`PrefillHandoff.check`)."""
        start = time.perf_counter()
        (shared,) = ray.get(handoffs)
        opened = self.handoff_receiver.open(shared)
        transfer_s = time.perf_counter() - start
        from rollout.async_engine import held_open

        with held_open(self.async_engine):
            futures = self.async_engine.submit_prefilled(list(zip(opened, params)))
            results = [self.followers.intact(f.result) for f in futures]
        version = results[0].weight_version if results else self.engine.weight_version
        return [routed_samples(r, self.return_routes) for r in results], {
            "weight_version": version,
            "pd_transfer_bytes": nbytes(opened),
            "pd_transfer_s": transfer_s,
            "pd_requests": len(opened),
        }

    @ray.method(num_returns="streaming")
    def decode_stream(
        self,
        handoffs: list,
        params: list,
        groups: list[int],
        quota: int | None,
        direct: dict[int, list[int]] | None = None,
    ):
        """`decode` as `generate_stream` streams (over-sampling): yields `(index, samples, weight
        version, per-sample token versions)` as each request finishes, then one dict:
        `decode`'s transfer counters, `weight_version`, `complete`, the groups complete within
        `quota` in completion order (the others aborted once `quota` were), and
        `parked_reused_tokens`. Request i is `direct[i]`'s prompt ids where given (computed
        here: an in-place continuation adopting the K/V this replica parked), else the next of
        the prefilled `handoffs` (`AsyncEngine.submit_prefilled`)."""
        from rollout.async_engine import AsyncEngine

        direct = direct or {}
        start = time.perf_counter()
        (shared,) = ray.get(handoffs) if handoffs else ([],)
        opened = self.handoff_receiver.open(shared)
        transfer_s = time.perf_counter() - start
        prefilled = iter(opened)
        requests = [direct[i] if i in direct else next(prefilled) for i in range(len(params))]
        from rollout.async_engine import held_open

        with held_open(self.async_engine):
            version = self.engine.weight_version
            before = self.engine.stats()
            futures = self.async_engine.submit_prefilled(
                list(zip(requests, params)), groups=groups, quota=quota
            )
            for item in finished_requests(futures, self.followers.intact, self.return_routes):
                version = item[2]
                yield item
            complete = AsyncEngine.complete_groups(futures).result() if futures else []
            after = self.engine.stats()
        yield {
            "weight_version": version,
            "complete": complete,
            **cache_counters(before, after, ("parked_reused_tokens",)),
            "pd_transfer_bytes": nbytes(opened),
            "pd_transfer_s": transfer_s,
            "pd_requests": len(opened),
        }

    def cached_prefix_lengths(self, prompts: list[list[int]]) -> list[int]:
        """A decode replica's answer to which later turns it prefills itself (`rollouts.
        replica_batcher`): how many leading tokens of each prompt its prefix cache holds now
        (`Engine.cached_prefix_lengths`), read between two steps of the step loop and without
        changing the cache (no lock, no reordering of what is evicted next)."""
        self.async_engine.hold()
        try:
            return self.engine.cached_prefix_lengths(prompts)
        finally:
            self.async_engine.unhold()

    @ray.method(num_returns="streaming", concurrency_group="serve")
    def decode_wave(self, handoffs: list, params: list, direct: dict[int, list[int]], wave: int):
        """The fully asynchronous producer's wave on a decode replica (`generate_wave`, its
        requests prefilled elsewhere): request i is `direct[i]`'s prompt ids where given
        (computed here: an in-place continuation adopting the K/V this replica parked), else the
        next of the prefilled `handoffs` (`[ref]` of a `prefill`'s, or `[]`). Admitted together,
        in order, in the serve group (so `close(abort_running=True)`, the weight sync and
        `cancel_wave` run while they decode). Yields `(index, samples, weight version, per-sample
        token versions)` as each request finishes, then one dict: the transfer's
        `pd_transfer_bytes`, `pd_transfer_s`, `pd_requests`, and `refused`, the requests whose
        handoff was prefilled at another weight version than this replica's when admitted (an
        update landed between: `StaleHandoff`, nothing of them yielded, to be prefilled again).
        With the window closed it yields CLOSED once and nothing else (nothing ran); when the
        handoffs' buffers died with their prefill replica, one dict with `gone` (nothing ran)."""
        from rollout.async_engine import EngineUnavailable
        from rollout.handoff import StaleHandoff

        start = time.perf_counter()
        try:
            (shared,) = ray.get(handoffs) if handoffs else ([],)
            with _OPENING:
                opened = self.handoff_receiver.open(shared)
        except HandoffGone:
            yield {"gone": True}
            return
        transfer_s = time.perf_counter() - start
        prefilled = iter(opened)
        requests = [direct[i] if i in direct else next(prefilled) for i in range(len(params))]
        try:
            futures = self.async_engine.submit_prefilled(list(zip(requests, params)))
        except EngineUnavailable:
            yield CLOSED
            return
        self._waves[wave] = futures
        refused = len(futures)
        try:
            for item in finished_requests(
                futures, self.followers.intact, self.return_routes, passed_over=StaleHandoff
            ):
                refused -= 1
                yield item
        finally:
            self._waves.pop(wave, None)
        yield {
            "pd_transfer_bytes": nbytes(opened),
            "pd_transfer_s": transfer_s,
            "pd_requests": len(opened),
            "refused": refused,
        }

    @ray.method(num_returns=2, concurrency_group="serve")
    def prefill_one(self, prompt_ids: list[int], params):
        """The HTTP endpoint's prefill (`RemotePrefill`), one request batched with every other
        concurrent call (the window must be open, as `generate_one`): counters with
        `handoff_key`, and the request's handoff in shared buffers."""
        future = self.async_engine.submit_prefill([(prompt_ids, params)])[0]
        handoff = self.followers.intact(future.result)
        key, shared = self.handoff_sender.share([handoff])
        return {"handoff_key": key}, shared
