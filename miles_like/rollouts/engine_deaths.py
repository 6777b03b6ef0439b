"""An engine replica that dies during a rollout: naming the death, and replacing the replica.

Rollouts run on the manager's asyncio loop, but a replacement (`RunActors.restart_engine`) is
made on the controller's thread: it takes the trainer's current weights, so no trainer call
may run meanwhile, which only the controller's thread can promise. The loop asks for it
(`RestartRequests.ask`, awaited) and the controller's thread, waiting on the rollout, makes it
(`RestartRequests.serve`).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from miles_like.run.calls import ActorDied, is_death


def engine_death(replica: int, method: str, error: BaseException) -> ActorDied:
    """`error`, raised by `method` on engine `replica`, as that engine's death; any other
    failure (the method's own exception) is raised again."""
    if not is_death(error):
        raise error
    return ActorDied(f"engine {replica}", method, error)


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    """Resolve `future` (None, or `error`) unless its waiter has gone."""
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class RestartRequests:
    """The replacements one rollout (or one producer call) asks the controller's thread for."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()

    async def ask(self, replica: int, died: ActorDied, *detail) -> None:
        """On the loop: replace `replica`; returns once the controller's thread has (raises
        what the replacement raised, e.g. the restart budget spent)."""
        done = self.loop.create_future()
        self._inbox.put((replica, died, detail, done))
        await done

    def close(self) -> None:
        """The rollout is over: `serve` returns."""
        self._inbox.put(None)

    def serve(
        self,
        restart: Callable[..., None],
        poll_s: float | None = None,
        idle: Callable[[], None] | None = None,
    ) -> None:
        """On the controller's thread, until `close`: `restart(replica, died, *detail)` for
        each request, and `idle()` after every `poll_s` without one (it may raise: a hang)."""
        while True:
            try:
                msg = self._inbox.get(timeout=poll_s)
            except queue.Empty:
                if idle is not None:
                    idle()
                continue
            if msg is None:
                return
            replica, died, detail, done = msg
            try:
                restart(replica, died, *detail)
            except BaseException as e:
                self.loop.call_soon_threadsafe(settle, done, e)
                raise
            self.loop.call_soon_threadsafe(settle, done, None)
