"""A thread-safe, asyncio-friendly front of one `Engine`: many callers, one step loop.

While an `AsyncEngine` is alive, its background thread is the only thread that touches the
engine's requests: submissions from any thread or event loop are queued, the thread adds them
(`Engine.add_request`) and calls `Engine.step()` while any is unfinished, so concurrent requests
are continuously batched by the engine's own scheduler (never one `generate` per request).

The serving window: `pause()` stops admitting (new submissions raise `EngineUnavailable`) and
returns once nothing is in flight (or everything was aborted); only then may the caller run
lifecycle calls on the engine (`update_weights`, `release_memory`, ...). `resume()` reopens.
Invariant: while paused nothing steps, so no request is served by half-updated weights, and
every request of a `GenerationResult` was sampled by the one `weight_version` it reports.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import NamedTuple

from rollout.config import SamplingParams
from rollout.engine import Engine
from rollout.sequence import SampleOutput, StopCheck


class EngineUnavailable(RuntimeError):
    """The engine is paused (weights or memory are being changed) or closed; retry later."""


class GenerationResult(NamedTuple):
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    weight_version: int  # the engine's weights that sampled every token of `samples`
    cached_tokens: int  # prompt tokens taken from the prefix cache at admission


class _Submission(NamedTuple):
    prompt_ids: list[int]
    params: SamplingParams
    stop_check: StopCheck | None
    future: Future


class AsyncEngine:
    def __init__(self, engine: Engine, open: bool = True):
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: deque[_Submission] = deque()
        self._in_flight = 0  # submitted and not yet resolved (inbox + engine)
        self._open = open
        self._abort_all = False
        self._stopping = False
        self._failure: BaseException | None = None  # the step loop died: nothing is served
        self._futures: dict[int, Future] = {}  # request id -> future (thread-owned)
        self._cancels: list[Future] = []
        self._thread = threading.Thread(target=self._loop, name="AsyncEngine", daemon=True)
        self._thread.start()

    # -- submitting ----------------------------------------------------------------------------
    def submit(
        self, prompt_ids: Seq[int], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> Future[GenerationResult]:
        """Queue one request (any thread). Raises `EngineUnavailable` while paused or closed;
        errors of the request itself (e.g. a prompt too long) reach the future."""
        (future,) = self.submit_many([(prompt_ids, params)], stop_check)
        return future

    def submit_many(
        self, requests: Seq[tuple[Seq[int], SamplingParams]], stop_check: StopCheck | None = None
    ) -> list[Future[GenerationResult]]:
        """Queue several requests at once, as `submit` does each: the step loop admits them
        together, in order, as `Engine.generate` does, so the batches they are computed in do
        not depend on thread timing (nor do the prefix-cache hits between them)."""
        futures: list[Future] = [Future() for _ in requests]
        with self._cond:
            if self._failure is not None:
                raise EngineUnavailable(f"engine step loop failed: {self._failure!r}")
            if self._stopping:
                raise EngineUnavailable("engine is closed")
            if not self._open:
                raise EngineUnavailable("engine is updating weights; retry")
            for (prompt_ids, params), future in zip(requests, futures):
                self._inbox.append(_Submission(list(prompt_ids), params, stop_check, future))
            self._in_flight += len(futures)
            self._cond.notify_all()
        return futures

    async def generate(
        self, prompt_ids: Seq[int], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> GenerationResult:
        """`submit` awaited from any asyncio loop. Cancelling the awaiting task (a timeout, a
        client gone) aborts the request in the engine."""
        future = self.submit(prompt_ids, params, stop_check)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.cancel(future)
            raise

    def cancel(self, future: Future) -> None:
        """Abort the request behind `future` (any thread): it ends now with finish_reason
        "abort" and the tokens it has (a finished request is left as it is)."""
        with self._cond:
            self._cancels.append(future)
            self._cond.notify_all()

    # -- the serving window --------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._open and not self._stopping and self._failure is None

    def pause(self, abort_running: bool = False, timeout: float | None = None) -> None:
        """Stop admitting and wait until nothing is in flight (with `abort_running`, unfinished
        requests end now with finish_reason "abort" and the tokens they have). Afterwards the
        step loop is idle until `resume()`: lifecycle calls on the engine are safe."""
        with self._cond:
            self._open = False
            if abort_running:
                self._abort_all = True
                self._cond.notify_all()
            try:
                if not self._cond.wait_for(lambda: self._in_flight == 0, timeout):
                    raise TimeoutError(
                        f"{self._in_flight} requests still in flight after {timeout} s"
                    )
            finally:
                self._abort_all = False

    def resume(self) -> None:
        with self._cond:
            self._open = True

    def close(self) -> None:
        """Abort what is in flight and stop the thread (idempotent)."""
        if self._thread.is_alive():
            self.pause(abort_running=True)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def stats(self) -> dict[str, int | float]:
        s = self.engine.stats()
        s["async_in_flight"] = self._in_flight
        return s

    # -- the step loop (background thread) -----------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._in_flight > 0)
                if self._stopping:
                    return
                new = list(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, []
                abort = self._abort_all
            for sub in new:
                self._add(sub)
            for request_id, future in self._futures.items():
                if abort or any(future is c for c in cancels):
                    self.engine.abort(request_id)
            if not self._futures:
                continue
            try:
                finished = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 -- delivered to every waiting caller
                self._fail_all(exc)
                continue
            for out in finished:
                future = self._futures.pop(out.request_id)
                future.set_result(
                    GenerationResult(
                        out.prompt_token_ids,
                        out.samples,
                        self.engine.weight_version,
                        out.cached_tokens,
                    )
                )
                self._resolved(1)

    def _add(self, sub: _Submission) -> None:
        if not sub.future.set_running_or_notify_cancel():  # cancelled while queued
            self._resolved(1)
            return
        try:
            request_id = self.engine.add_request(sub.prompt_ids, sub.params, sub.stop_check)
        except Exception as exc:  # noqa: BLE001 -- the request's own error, e.g. too long
            sub.future.set_exception(exc)
            self._resolved(1)
            return
        self._futures[request_id] = sub.future

    def _fail_all(self, exc: BaseException) -> None:
        """A step raised: every in-flight request fails with it. The engine's requests are
        aborted so it can serve again; if even that fails, the AsyncEngine refuses from now on."""
        futures, self._futures = self._futures, {}
        for request_id in futures:
            self.engine.abort(request_id)
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException as again:  # noqa: BLE001
            with self._cond:
                self._failure = again
        for future in futures.values():
            future.set_exception(exc)
        self._resolved(len(futures))

    def _resolved(self, count: int) -> None:
        with self._cond:
            self._in_flight -= count
            self._cond.notify_all()
