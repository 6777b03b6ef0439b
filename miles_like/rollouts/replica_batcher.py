"""Requests of the rollout functions -> batched `EngineWorker.generate` calls on the replicas.

All rollout functions of a rollout run on one asyncio loop. A request is queued on its
replica; the replica's queue is sent as one `generate` call as soon as the replica is idle, once
every task that was ready when the request arrived has run (`call_soon`). So the first turns of
all groups leave in one call per replica, in the order of the groups, which is exactly the call
the single-turn rollout always made; later turns that become ready together travel together.
Batching by the engine's own step loop is what makes concurrent sessions cheap.

Under prefill-decode the queues of every idle replica leave together, as one wave: its batches
share their prefill calls (`PrefillDecode.generate`: one per prefill replica), as a plain replica
prefills its whole batch in one call, and each replica is free again once its own decode returns.
But a later turn whose part not yet in its decode replica's prefix cache is short
(`rollout.pd_local_prefill_tokens`) goes to that replica as a plain `generate`: it holds the
session's earlier turns whole, completions included, which a prefill replica never saw
(`PrefillDecode.split_local`); its counters are that replica's (`rollout/pd_local_prefills`).

A call holds only first turns or only later turns (a request extending an earlier one of its
group), so the engine's prefix-cache counters of the call say how well later turns reuse the
KV of the earlier ones (`rollout/prefix_cache_hit_rate_turn2plus`).

An engine that dies is replaced (`restarts.ask`, awaited: the controller does it on its own
thread, `engine_deaths.py`) and the lost call is sent again, with the same seeds, to the
replacement. A call that outlives `timeout_s`, or an engine that dies with no `restarts`, fails
every waiting request and is kept in `failure`, which the controller raises whatever the rollout
functions did with it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from miles_like.rollouts.engine_deaths import RestartRequests, engine_death
from miles_like.rollouts.prefill_then_decode import PD_COUNTERS, PrefillDecode, all_of
from miles_like.run.calls import Call, CallTimeout

T = TypeVar("T")

COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")


class Generation(NamedTuple):
    """One sample the engine returned for a request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int  # the engine's weight version when it finished
    # The version that sampled each token, where an update landed while it ran (in-place
    # updates); () when `weight_version` sampled every token.
    versions: tuple[int, ...] = ()
    # A mixture of experts' routes of the request's every computed token: [input + generated
    # - 1, sparse layers, k] (`sample_routes`); None for a dense model or routes not kept.
    routes: torch.Tensor | None = None


class _Request(NamedTuple):
    prompt_ids: list[int]
    params: Any  # rollout.SamplingParams
    later_turn: bool
    future: asyncio.Future  # -> list[Generation], one per sample of params.n


class ReplicaBatcher:
    """Batches the rollout functions' requests per replica. `engines` is read at every call
    (the owner replaces a dead engine in it)."""

    def __init__(
        self,
        engines: list,
        timeout_s: float,
        restarts: RestartRequests | None = None,
        prefill_replicas: int = 0,
        local_prefill_tokens: int = 0,
    ):
        self.engines = engines
        self.timeout_s = timeout_s
        self.restarts = restarts
        # prefill-decode: engines[:k] prefill, the requests' replicas decode (`prefill_decode`)
        self.pd = (
            PrefillDecode(self, prefill_replicas, local_prefill_tokens)
            if prefill_replicas
            else None
        )
        self.tallies: Counter = Counter()  # COUNTERS (+ "_turn2plus"), generated_tokens, ...
        self.failure: BaseException | None = None
        self.last_progress = time.monotonic()
        self._queues: list[list[_Request]] = [[] for _ in engines]
        self._busy = [False] * len(engines)
        self._tasks: set[asyncio.Task] = set()
        self._replacing: dict[int, asyncio.Future] = {}  # replica -> its replacement, asked

    async def generate(
        self, replica: int, prompt_ids: Sequence[int], params, later_turn: bool
    ) -> list[Generation]:
        if self.failure is not None:
            raise self.failure
        future = asyncio.get_running_loop().create_future()
        self._queues[replica].append(_Request(list(prompt_ids), params, later_turn, future))
        if len(self._queues[replica]) == 1 and not self._busy[replica]:
            asyncio.get_running_loop().call_soon(self._flush, replica)
        return await future

    def _flush(self, i: int) -> None:
        if self._busy[i] or not self._queues[i]:
            return
        # prefill-decode: every idle replica's queue leaves with i's, a wave whose prompts share
        # the prefill calls (`PrefillDecode.generate`), as one plain replica prefills its batch
        # in one call; formed here, from the queues alone, so no timing decides it
        wave = (
            [j for j, q in enumerate(self._queues) if q and not self._busy[j]] if self.pd else [i]
        )
        batches: dict[int, list[_Request]] = {}
        for j in wave:
            batches[j], self._queues[j] = self._queues[j], []
            self._busy[j] = True
        task = asyncio.get_running_loop().create_task(self._send_all(batches))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_all(self, batches: dict[int, list[_Request]]) -> None:
        """A wave's batches: their first turns, then their later turns (a call holds one kind).
        A replica is free for its next batch as soon as its part of the last kind it holds has
        returned."""
        last_kind = {j: any(r.later_turn for r in batch) for j, batch in batches.items()}
        held = set(batches)

        def free(j: int) -> None:
            if j in held:
                held.discard(j)
                self._busy[j] = False
                if self._queues[j]:
                    self._flush(j)

        def returned(j: int, later: bool) -> None:
            if last_kind[j] == later:
                free(j)

        try:
            for later in (False, True):
                parts = {j: [r for r in b if r.later_turn == later] for j, b in batches.items()}
                parts = {j: part for j, part in parts.items() if part}
                if parts:
                    await self._send(parts, later, returned)
        finally:
            for j in sorted(held):
                free(j)

    async def _send(
        self, parts: dict[int, list[_Request]], later: bool, returned: Callable[[int, bool], None]
    ) -> None:
        """One kind of a wave's batches: replica j's `parts[j]` served (`_generate_on`), or under
        prefill-decode every replica's through the shared prefill calls, but the later turns
        its decode replica prefills itself (`PrefillDecode.split_local`); each replica told
        once all of its results are delivered: `returned(j, later)`."""
        try:
            if self.pd is None:
                ((i, part),) = parts.items()
                await self._generate_on(i, part, later, lambda: returned(i, later))
                return
            local, remote = await self.pd.split_local(parts) if later else ({}, parts)
            waiting = Counter([*local, *remote])  # j -> its parts not yet delivered

            def delivered(j: int) -> None:
                waiting[j] -= 1
                if not waiting[j]:
                    returned(j, later)

            def deliver_remote(d: int, outs: list, counters: dict) -> None:
                self._deliver(remote[d], outs, counters)
                delivered(d)

            # the local calls first: each reaches its decode replica before that replica's
            # decode of the prefilled part (sent after the prefill), so it runs first there
            calls = [
                self._generate_on(d, part, later, lambda d=d: delivered(d))
                for d, part in local.items()
            ]
            if remote:
                calls.append(
                    self.pd.generate(
                        {
                            d: ([r.prompt_ids for r in part], [r.params for r in part])
                            for d, part in remote.items()
                        },
                        lambda counters: self._tally_prefill(counters, later),
                        deliver_remote,
                    )
                )
            await all_of(calls)
        except BaseException as e:
            self.failure = self.failure or e
            for part in parts.values():
                for r in part:
                    if not r.future.done():
                        r.future.set_exception(e)
            if not isinstance(e, Exception):
                raise

    async def _generate_on(
        self, i: int, part: list[_Request], later: bool, delivered: Callable[[], None]
    ) -> None:
        """`part` as one `generate` on engine i (it prefills them itself), its counters tallied
        and its samples delivered; then `delivered()`."""
        outs, counters = await self._call(i, [r.prompt_ids for r in part], [r.params for r in part])
        self._tally_prefill(counters, later)
        if self.pd is not None:
            self.tallies["pd_local_prefills"] += len(part)
        self._deliver(part, outs, counters)
        delivered()

    def _tally_prefill(self, counters: dict, later: bool) -> None:
        """A call's prefix-cache counters (later turns' also under "_turn2plus")."""
        for k in COUNTERS:
            self.tallies[k] += counters[k]
            if later:
                self.tallies[k + "_turn2plus"] += counters[k]

    def _deliver(self, part: list[_Request], outs: list, counters: dict) -> None:
        """`part`'s samples to its waiters, stamped with the version that sampled them."""
        self.last_progress = time.monotonic()
        version = int(counters["weight_version"])
        for k in PD_COUNTERS:
            if k in counters:
                self.tallies[k] += counters[k]
        for r, samples in zip(part, outs):
            self.tallies["generated_tokens"] += sum(len(s.token_ids) for s in samples)
            if not r.future.done():  # a cancelled waiter (its group failed) takes nothing
                r.future.set_result(
                    [
                        Generation(
                            list(s.token_ids),
                            list(s.logprobs),
                            s.finish_reason,
                            version,
                            routes=s.routes,
                        )
                        for s in samples
                    ]
                )

    async def stream(
        self,
        i: int,
        prompts: list[list[int]],
        params: list,
        groups: list[int],
        quota: int | None,
        on_result: Callable[[int, list[Generation]], None],
        direct: list[bool] | None = None,
    ) -> list[int]:
        """One `generate_stream` call on engine i (over-sampled rollouts): `on_result(index,
        samples)` as each request finishes, on this loop; returns the groups complete within
        `quota` in completion order. An engine that dies is replaced and the whole call sent
        again (same seeds, same outcome); what was already delivered is not delivered twice.
        Prefill-decode: the requests are prefilled on a prefill replica and streamed from engine
        i's `decode_stream` (`PrefillDecode.stream`), but those flagged in `direct` (in-place
        continuations, whose K/V engine i parked), which engine i computes itself."""
        delivered: set[int] = set()

        def consume(gen, method: str) -> Awaitable[dict]:
            return self._consume(i, method, gen, delivered, on_result)

        if self.pd is not None:
            counters = await self.pd.stream(i, prompts, params, groups, quota, consume, direct)
        else:

            async def attempt() -> dict:
                gen = self.engines[i].generate_stream.remote(prompts, params, groups, quota)
                return await consume(gen, "generate_stream")

            counters = await self.with_replacement(i, "generate_stream", len(prompts), attempt)
        for k in COUNTERS:
            self.tallies[k] += counters[k]
        for k in PD_COUNTERS:
            if k in counters:
                self.tallies[k] += counters[k]
        self.tallies["parked_reused_tokens"] += counters.get("parked_reused_tokens", 0)
        return list(counters["complete"])

    async def _consume(
        self,
        i: int,
        method: str,
        gen,
        delivered: set[int],
        on_result: Callable[[int, list[Generation]], None],
    ) -> dict:
        """Engine i's stream `gen` (`generate_stream` / `decode_stream`) read to its closing
        counters, each request not yet `delivered` handed to `on_result`."""
        try:
            while True:
                try:
                    ref = await asyncio.wait_for(gen.__anext__(), self.timeout_s)
                except StopAsyncIteration:
                    raise RuntimeError(f"engine {i} {method} ended without its counters") from None
                item = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
                self.last_progress = time.monotonic()
                if isinstance(item, dict):
                    return item
                k, samples, version, sample_versions = item
                if k not in delivered:
                    delivered.add(k)
                    self.tallies["generated_tokens"] += sum(len(s.token_ids) for s in samples)
                    on_result(
                        k,
                        [
                            Generation(
                                list(s.token_ids),
                                list(s.logprobs),
                                s.finish_reason,
                                version,
                                tuple(v) if set(v) - {version} else (),
                                s.routes,
                            )
                            for s, v in zip(samples, sample_versions)
                        ],
                    )
        except TimeoutError:
            raise CallTimeout([Call(f"engine {i}", method, None)], self.timeout_s) from None

    async def _call(self, i: int, prompts: list[list[int]], params: list):
        """One `generate` on engine i, sent again to its replacement if it dies."""

        async def attempt():
            ref = self.engines[i].generate.remote(prompts, params)
            try:
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
            except TimeoutError:
                raise CallTimeout([Call(f"engine {i}", "generate", ref)], self.timeout_s) from None

        return await self.with_replacement(i, "generate", len(prompts), attempt)

    async def with_replacement(
        self, i: int, method: str, requests: int, attempt: Callable[[], Awaitable[T]]
    ) -> T:
        """`attempt()`, a `method` call of `requests` requests on engine i, made again on the
        replacement while the engine it reached dies (same seeds: the same outcome). Calls that
        see the same engine die (prefill-decode: several decode replicas' batches share a
        prefill replica) wait for one replacement."""
        while True:
            engine = self.engines[i]  # the one `attempt` reaches (no await in between)
            try:
                return await attempt()
            except Exception as e:
                died = engine_death(i, method, e)
                if self.restarts is None:
                    raise died from None
                await self._replace(i, engine, died, requests)
                self.last_progress = time.monotonic()

    async def _replace(self, i: int, engine, died, requests: int) -> None:
        if self.engines[i] is not engine:
            return  # replaced already, after another call saw it die
        pending = self._replacing.get(i)
        if pending is None:
            pending = asyncio.ensure_future(self.restarts.ask(i, died, requests))
            self._replacing[i] = pending
            pending.add_done_callback(lambda _: self._replacing.pop(i, None))
            self.tallies["engine_restarts"] += 1
        await asyncio.shield(pending)
