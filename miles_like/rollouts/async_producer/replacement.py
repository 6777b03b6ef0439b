"""The engine replicas as the producer sees them, and the replacement of dead ones.

A replica that dies (found by its wave or by a call on every replica) is marked dead and
replaced by the controller's thread at its next producer call (`AsyncProducer._run`: no trainer
call runs meanwhile, so the replacement takes the engines' weights). Meanwhile its groups
wait, with the tokens, log-probs and versions they had delivered (whatever it was computing is
lost: retract), and are sent again once it is back, to whichever replicas the next fill gives
them. A death is a handle's: a late failure of the replaced actor's calls is not the new one's.
Under prefill-decode disaggregation prefill replicas are replaced the same way (`prefill`, the
waves' prefill half: `disaggregated.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from miles_like.errors import RolloutFailed
from miles_like.rollouts.async_producer.disaggregated import PrefillWaves
from miles_like.rollouts.engine_deaths import RestartRequests, engine_death
from miles_like.run.calls import ActorDied, is_death
from miles_like.run.engine_worker import CLOSED


class Replicas:
    """`engines` is the manager's list (a replacement is put in it, read at every call).
    `on_replaced(i, engine)` readies a replacement (its counters, its window), `refill()`
    runs after every round of replacements (their groups are sent again). With
    `prefill_replicas` k, engines[:k] prefill the waves of the others (`prefill`)."""

    def __init__(
        self,
        engines: list,
        timeout_s: float,
        can_restart: bool,
        on_replaced: Callable[[int, object], Awaitable[None]],
        refill: Callable[[], None],
        prefill_replicas: int = 0,
    ):
        self.engines = engines
        self.timeout = timeout_s
        self.can_restart = can_restart
        self.on_replaced, self.refill = on_replaced, refill
        self.dead: dict[int, ActorDied] = {}  # found dead, not yet replaced
        self.restarts: RestartRequests | None = None  # the current producer call's
        self._wave_ids = 0
        self.prefill = PrefillWaves(self, prefill_replicas) if prefill_replicas else None

    @property
    def decoding(self) -> range:
        """The replicas waves are sent to: every one, or the decode replicas (engines[k:])."""
        return range(self.prefill.count if self.prefill is not None else 0, len(self.engines))

    def next_wave_id(self) -> int:
        """A new id naming a `generate_wave` call (`cancel_wave` takes it)."""
        self._wave_ids += 1
        return self._wave_ids

    async def call(self, ref):
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout)

    def failed(self, i: int, handle, method: str, error: BaseException) -> None:
        """`method` on replica i (`handle`) raised `error`: the replica is dead (replaced at
        the next call that replaces); any other failure is raised again."""
        died = engine_death(i, method, error)
        if self.engines[i] is handle:
            self.dead.setdefault(i, died)

    async def replace_dead(self) -> None:
        """Replace every dead replica (or raise its death: no restarts), then `refill()`."""
        while self.dead:
            i = min(self.dead)
            if not self.can_restart:
                raise self.dead[i]
            await self.restarts.ask(i, self.dead[i])
            del self.dead[i]
            engine = self.engines[i]
            try:
                await self.on_replaced(i, engine)
            except Exception as e:
                self.failed(i, engine, "stats", e)
        self.refill()

    async def on_every(self, method: str, *args, replace: bool = True) -> list | None:
        """`method` on every replica; one found dead is replaced and every replica asked again
        (the calls made this way are idempotent: open, close, stats). With `replace` false,
        None once a replica is found dead (the next call with `replace` replaces it)."""
        while True:
            if self.dead and not replace:
                return None
            await self.replace_dead()
            handles = list(self.engines)
            results = await asyncio.gather(
                *(self.call(getattr(e, method).remote(*args)) for e in handles),
                return_exceptions=True,
            )
            for i, (handle, r) in enumerate(zip(handles, results)):
                if isinstance(r, BaseException):
                    self.failed(i, handle, method, r)
            if not self.dead:
                return results

    async def cancel_waves(self, requests: dict[tuple[int, int], list[int]]) -> None:
        """Abort requests of running waves, `(replica, wave id) -> request indices` (they come
        back through their waves with the tokens they have). A replica that dies meanwhile is
        replaced at the next call that replaces."""
        calls = [
            (replica, self.engines[replica], wave, ks) for (replica, wave), ks in requests.items()
        ]
        results = await asyncio.gather(
            *(self.call(engine.cancel_wave.remote(wave, ks)) for _, engine, wave, ks in calls),
            return_exceptions=True,
        )
        for (replica, engine, _, _), r in zip(calls, results):
            if isinstance(r, BaseException):
                self.failed(replica, engine, "cancel_wave", r)

    async def stream_wave(
        self, replica: int, prompts: list, params: list, wave: int, on_item
    ) -> RolloutFailed | None:
        """Send one wave to `replica` and pass what it streams back, item by item, to
        `on_item` until the engine closes the window (`read_stream`)."""
        engine = self.engines[replica]
        return await self.read_stream(
            replica,
            engine,
            "generate_wave",
            lambda: engine.generate_wave.remote(prompts, params, wave),
            on_item,
        )

    async def read_stream(
        self, replica: int, engine, method: str, start: Callable, on_item
    ) -> RolloutFailed | None:
        """`start()` (a streaming `method` of `replica`'s `engine`) read item by item into
        `on_item` until it ends or yields CLOSED. A death marks the replica dead; any other
        failure (the engine's or `on_item`'s) is returned, for `take` to raise. Either ends the
        wave; the caller's bookkeeping sends again what did not come back."""
        try:
            gen = start()
            while True:
                try:
                    ref = await asyncio.wait_for(gen.__anext__(), self.timeout)
                except StopAsyncIteration:
                    break
                item = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout)
                if isinstance(item, str) and item == CLOSED:
                    break
                on_item(item)
        except Exception as e:  # noqa: BLE001 -- raised to the controller by `take`
            if not is_death(e):
                return RolloutFailed(f"engine {replica}: {method} failed: {type(e).__name__}: {e}")
            self.failed(replica, engine, method, e)
        return None
