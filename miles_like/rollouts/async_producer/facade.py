"""`AsyncProducer`: the controller's blocking calls into the producer, which lives on the
rollout manager's asyncio loop (`RolloutManager.loop`).

Each call runs its coroutine on that loop while the controller's thread waits, and meanwhile
makes the engine replacements the coroutine asks for (`engine_deaths.RestartRequests`), as the
synchronous loop does in `RolloutManager.finish`: no trainer call runs meanwhile, so the weights
a replacement takes from the trainer are those of the engines' version (at `pause`, already the
next one, which the update then gives it with its number, before it generates).
"""

from __future__ import annotations

import asyncio

from miles_like.rollouts.agents import AgentGroups
from miles_like.rollouts.async_producer import update
from miles_like.rollouts.async_producer.buffer import Buffer
from miles_like.rollouts.async_producer.ledger import AsyncBatch, Flow, Ledger
from miles_like.rollouts.async_producer.replacement import Replicas
from miles_like.rollouts.async_producer.sending import PositionParams, Sender
from miles_like.rollouts.async_producer.state import checkpoint_state, restore
from miles_like.rollouts.engine_deaths import RestartRequests
from miles_like.run.calls import ActorDied


class AsyncProducer:
    """Keeps `manager`'s engines generating into a buffer of at most `capacity` groups
    (`cluster.async_buffer_groups`) that the trainer takes batches from, none staler than
    `max_staleness` weight versions. Its parts share `ledger` (where every drawn group is) and
    `flow` (version, accepting, failure, waves)."""

    def __init__(self, manager, capacity: int, max_staleness: int):
        self.manager = manager
        recipe = manager.recipe
        self.max_staleness = max_staleness
        self.keep_partial = recipe.rollout.partial != "abort"
        self.ledger, self.flow = Ledger(capacity), Flow()
        self.replicas = Replicas(
            manager.engines,
            recipe.cluster.call_timeout_s,
            manager.restart_engine is not None,
            on_replaced=self._replaced,
            refill=self._refill,
            prefill_replicas=recipe.rollout.prefill_replicas,
        )
        self.buffer = Buffer(
            recipe,
            manager.scorer,
            self.ledger,
            self.flow,
            self.replicas,
            max_staleness,
            self._refill,
        )
        params = PositionParams(manager)
        # a multi-turn rollout function: each group is a task running it (`agents.py`)
        self.agents = (
            AgentGroups(manager, self.ledger, self.flow, self.replicas, self.buffer, params)
            if recipe.rollout.function != "single_turn"
            else None
        )
        self.sender = Sender(
            manager,
            self.ledger,
            self.flow,
            self.replicas,
            self.buffer,
            params,
            max_staleness,
            self.agents,
        )

    # ------------------------------------------------------------------------ blocking API
    def start(self, version: int, state: dict | None = None) -> None:
        """Open the engines and begin producing (from a checkpoint's `state`, if given)."""
        self.flow.version = version
        self._run(self._start(state))

    def take(self, count: int, version: int) -> AsyncBatch:
        """The next `count` groups for the trainer, at trainer (= engines') `version`."""
        self.flow.version = version
        return self._run(self.buffer.take(count, version))

    def take_ahead(self, count: int, version: int, training) -> AsyncBatch | None:
        """The next step's batch, for trainer version `version` (the one the step being trained
        will produce), taken while `training` (an ObjectRef: that step's train call) runs, so
        that the next train call can start right after the weight update. None, and nothing
        taken, once `training` is done first, or when an engine is dead (its replacement takes
        the trainer's weights: it waits for the update, after the train call). The engines stay
        at their version; a group staler than max_staleness at `version` is dropped, as
        `take` at `version` would drop it."""
        return self._run(self.buffer.take(count, version, training))

    def pause(self, abort: bool = True) -> None:
        """Stop sending; with `abort`, abort every running request and wait until all of them
        are back (without, `rollout.partial: in_place`, they keep running through the update)."""
        self._run(update.pause(self.flow, self.replicas, abort))

    def drop_stale(self, version: int) -> None:
        """After the update to `version`: free the trained batch's room, drop the open groups
        that can no longer be trained (and, with partial: abort, the unfinished ones)."""
        self.flow.version = version
        self._run(
            update.drop_stale(
                self.ledger, self.replicas, version, self.max_staleness, self.keep_partial
            )
        )

    def resume(self) -> None:
        """Reopen the engines, draw prompts up to the capacity and send what waits."""
        self._run(update.resume(self.flow, self.replicas, self.sender))

    def state(self) -> dict:
        """The checkpoint's `async` (between `pause` and `resume`: no request runs)."""
        return self._run(_on_loop(checkpoint_state, self.ledger))

    def drops(self) -> tuple[list[int], list[int], list[int]]:
        """(stale, aborted) indices dropped since the last call, and the held ones (open,
        buffered) at the same moment: with in_place, a group may be dropped at any time."""
        return self._run(_on_loop(self.ledger.report))

    def held_indices(self) -> list[int]:
        return self._run(_on_loop(self.ledger.held))

    # ---------------------------------------------------------------------------- plumbing
    def _run(self, coro):
        """`coro` on the manager's loop while this (the controller's) thread waits, replacing
        the engines `coro` finds dead here."""
        loop = self.manager.loop
        restarts = self.replicas.restarts = RestartRequests(loop)
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        future.add_done_callback(lambda _: restarts.close())
        restarts.serve(self._restart)
        return future.result()

    def _restart(self, i: int, died: ActorDied) -> None:
        waiting = sum(not g.running for g in self.ledger.open.values())
        self.manager.restart_engine(i, died)
        self.manager.log(
            f"{died}; replaced it at weight version {self.flow.version}: the {waiting} open "
            f"groups waiting continue from the tokens they had "
            f"({self.manager.source.consumed} prompts drawn)"
        )

    async def _start(self, state: dict | None) -> None:
        if state is not None:
            restore(state, self.ledger, self.buffer, self.agents, self.manager.log)
        await self.buffer.start_window()
        await update.resume(self.flow, self.replicas, self.sender)

    async def _replaced(self, i: int, engine) -> None:
        """A replacement's counters start the window again; it admits work if the rest do."""
        self.buffer.engine_replaced(i, await self.replicas.call(engine.stats.remote()))
        if self.flow.accepting:
            await self.replicas.call(engine.open.remote())

    def _refill(self) -> None:
        self.sender.fill()


async def _on_loop(fn, *args):
    """`fn(*args)` on the rollout loop, which owns the producer's state."""
    return fn(*args)
