"""A thread-safe, asyncio-friendly front of one `Engine`: many callers, one step loop.

While an `AsyncEngine` is alive, its background thread is the only thread that touches the
engine's requests: submissions from any thread or event loop are queued, the thread adds them
(`Engine.add_request`) and calls `Engine.step()` while any is unfinished, so concurrent requests
are continuously batched by the engine's own scheduler (never one `generate` per request).

The serving window: `pause()` stops admitting (new submissions raise `EngineUnavailable`) and
returns once nothing is in flight (or everything was aborted); only then may the caller run
lifecycle calls on the engine (`update_weights`, `release_memory`, ...). `resume()` reopens.
Invariant: while paused nothing steps, so no request is served by half-updated weights.

A weight update without a drain (`update_weights_between_steps`, or `hold()` ... `unhold()`
around bucketed `Engine.load_weights(keep_running=True)` + `commit_weights`): the step loop parks
between two forward passes, requests in flight keep their K/V and sample on with the new
weights once it is released (`in_place`); submissions made meanwhile wait in the inbox. Each
token's version is in `GenerationResult.sample_versions`; its `weight_version` is the engine's
when the request finished (the only one unless an update landed while it ran).

Streaming (`stream`): after every engine step the step loop hands each streamed request's new
tokens (`TokenDelta`, per sample) to the caller's event loop; the request's `GenerationResult`
comes last. The tokens are the ones `generate` would return: streaming only reads them earlier.

A quota (`submit_many(..., groups=, quota=)`, over-sampling): the requests belong to groups; a
group is complete once all of its requests are; once `quota` groups are complete the step loop
aborts the batch's other requests before its next step (they end with finish_reason "abort" and
the tokens they have). Which groups are complete, and where the others stop, is decided by the
step loop alone: groups complete in the order of the engine step that finished their last
request, ties by group id, so given the same submissions the outcome does not depend on timing.

Prefill-decode disaggregation (`rollout.prefill_decode`) goes through the same step loop:
`submit_prefill` resolves with each prompt's `PrefillHandoff` (its first tokens sampled),
`submit_prefilled` admits handoffs another engine made and resolves as `submit_many` does, and
`stream(prompt_ids, params, handoff=h)` streams one (its first tokens in the first deltas).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import NamedTuple

import torch

from rollout.config import SamplingParams
from rollout.engine import Engine
from rollout.prefill_decode import PendingPrefill, PrefillHandoff, start_prefill
from rollout.sequence import RequestOutput, SampleOutput, StopCheck, TopLogprobs


class EngineUnavailable(RuntimeError):
    """The engine is paused (weights or memory are being changed) or closed; retry later."""


class GenerationResult(NamedTuple):
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    weight_version: int  # the engine's when it finished (see sample_versions)
    cached_tokens: int  # prompt tokens taken from the prefix cache at admission
    # Per sample, the version that sampled each token (`RequestOutput.weight_versions`).
    sample_versions: tuple[list[int], ...] = ()
    # `SamplingParams.prompt_logprobs` (`RequestOutput`); None unless asked
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    # Mixture of experts: per sample, each computed token's experts (`RequestOutput.routed_experts`)
    routed_experts: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def of(cls, out: RequestOutput, weight_version: int) -> GenerationResult:
        return cls(
            out.prompt_token_ids,
            out.samples,
            weight_version,
            out.cached_tokens,
            out.weight_versions,
            out.prompt_logprobs,
            out.prompt_top_logprobs,
            out.routed_experts,
        )


class TokenDelta(NamedTuple):
    """A streamed request's tokens of one sample since its previous delta (`AsyncEngine.stream`);
    a sample's last delta carries its finish reason (and may have no tokens)."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None  # with `SamplingParams.top_logprobs` only
    finish_reason: str | None


# Called on the step loop's thread with each delta, then the request's result.
StreamListener = Callable[["TokenDelta | GenerationResult"], None]


class _Streams:
    """The streamed requests of the step loop (thread-owned): each one's listener and how many
    tokens of each sample it was handed."""

    def __init__(self):
        self.by_request: dict[int, tuple[StreamListener, list[int]]] = {}

    def add(self, request_id: int, listener: StreamListener, n: int) -> None:
        self.by_request[request_id] = (listener, [0] * n)

    def progress(self, scheduler) -> None:
        """Hand every streamed request's unfinished samples' new tokens to its listener."""
        for seq in (*scheduler.running, *scheduler.waiting):
            entry = self.by_request.get(seq.request.request_id)
            if entry is None or seq.num_generated <= entry[1][seq.sample_index]:
                continue
            listener, sent = entry
            j, start = seq.sample_index, sent[seq.sample_index]
            sent[j] = seq.num_generated
            top = seq.top_logprobs[start:] if seq.request.params.top_logprobs else None
            new = seq.token_ids[seq.prompt_len + start :]
            listener(TokenDelta(j, new, seq.logprobs[start:], top, None))

    def finished(self, request_id: int, result: GenerationResult) -> None:
        """The request is done: each sample's last delta (its finish reason), then the result."""
        entry = self.by_request.pop(request_id, None)
        if entry is None:
            return
        listener, sent = entry
        for j, sample in enumerate(result.samples):
            start = sent[j]
            top = sample.top_logprobs[start:] if sample.top_logprobs is not None else None
            listener(
                TokenDelta(
                    j, sample.token_ids[start:], sample.logprobs[start:], top, sample.finish_reason
                )
            )
        listener(result)


class _Submission(NamedTuple):
    prompt_ids: list[int]
    params: SamplingParams
    stop_check: StopCheck | None
    future: Future
    quota: _Quota | None = None
    group: int = 0
    listener: StreamListener | None = None
    prefill: bool = False  # prefill-decode: compute the prompt, resolve with its handoff
    handoff: PrefillHandoff | None = None  # prefill-decode: admit this prefilled request
    # prefill-decode: admitted after one step of the requests submitted with it that this
    # engine computes itself (`submit_prefilled`)
    after_a_step: bool = False


class _Quota:
    """The groups of one `submit_many` call with a quota (step-loop owned but `complete`)."""

    def __init__(self, groups: Seq[int], quota: int):
        self.left: dict[int, int] = {}  # group -> its requests not finished
        for g in groups:
            self.left[g] = self.left.get(g, 0) + 1
        self.quota = quota
        self.request_ids: set[int] = set()
        self.complete: Future[list[int]] = Future()  # -> the complete groups, in order
        self._done: list[int] = []
        self._unresolved = len(groups)

    @property
    def reached(self) -> bool:
        """`quota` groups are complete: the rest are aborted."""
        return len(self._done) >= self.quota

    def finished(self, groups_now: list[int]) -> list[int] | None:
        """The groups whose requests finished in one step; the request ids to abort once the
        quota is reached (None before)."""
        newly = []
        for g in groups_now:
            self.left[g] -= 1
            if self.left[g] == 0:
                newly.append(g)
        self._unresolved -= len(groups_now)
        reached = False
        if not self.complete.done():
            for g in sorted(newly):
                self._done.append(g)
                if len(self._done) == self.quota:
                    reached = True
                    break
            if reached or self._unresolved == 0:
                self.complete.set_result(list(self._done))
        return sorted(self.request_ids) if reached else None

    def failed(self) -> None:
        """A request that never ran (cancelled, refused, its step failed): its group cannot
        complete; the others still can."""
        self._unresolved -= 1
        if self._unresolved == 0 and not self.complete.done():
            self.complete.set_result(list(self._done))


def quota_of(futures: list[Future], groups: Seq[int] | None, quota: int | None) -> _Quota | None:
    """The `_Quota` of one submission of requests (one future each) in `groups`, each future
    naming it (`AsyncEngine.complete_groups`); None without a quota."""
    if quota is None:
        return None
    if groups is None or len(groups) != len(futures):
        raise ValueError("a quota needs one group id per request")
    if quota < 1:
        raise ValueError(f"quota={quota}: must be >= 1")
    q = _Quota(groups, quota)
    if not futures:
        q.complete.set_result([])
    for f in futures:
        f.quota = q  # type: ignore[attr-defined]
    return q


class _PrefillDecodeRequests:
    """`AsyncEngine`'s prefill-decode requests (module doc), and how its step loop adds any."""

    engine: Engine
    _prefills: dict[int, PendingPrefill]
    _enqueue: Callable[[list[_Submission]], None]

    def submit_prefill(
        self, requests: Seq[tuple[Seq[int], SamplingParams]]
    ) -> list[Future[PrefillHandoff]]:
        """Prefill-decode, the prefill side (`rollout.prefill_decode.prefill`): each prompt
        computed and its samples' first tokens sampled, admitted together as `submit_many`;
        each future resolves with the request's `PrefillHandoff`."""
        futures: list[Future] = [Future() for _ in requests]
        self._enqueue(
            [
                _Submission(list(prompt_ids), params, None, future, prefill=True)
                for (prompt_ids, params), future in zip(requests, futures)
            ]
        )
        return futures

    def submit_prefilled(
        self,
        requests: Seq[tuple[PrefillHandoff | Seq[int], SamplingParams]],
        *,
        groups: Seq[int] | None = None,
        quota: int | None = None,
    ) -> list[Future[GenerationResult]]:
        """Prefill-decode, the decode side (`Engine.admit_prefilled`): requests another engine
        prefilled, with the params they were prefilled with, admitted together in order; with
        `groups` and `quota` as `submit_many` (over-sampling).

        A request given as prompt ids instead is this engine's to compute (an in-place
        continuation adopting the K/V it parked here: nothing to re-send). Those run one step
        before the prefilled ones are admitted: a prefilled request's first token was sampled
        by the prefill engine, one step ahead of where one engine doing both would be, so its
        own requests must be one step ahead too for the steps that complete each group (a
        quota's order) to be those of one engine."""
        futures: list[Future] = [Future() for _ in requests]
        q = quota_of(futures, groups, quota)
        own = any(not isinstance(r, PrefillHandoff) for r, _ in requests)
        subs = []
        for k, ((request, params), future) in enumerate(zip(requests, futures)):
            group = groups[k] if q else 0
            if isinstance(request, PrefillHandoff):
                sub = _Submission(
                    list(request.prompt_token_ids), params, None, future, q, group
                )._replace(handoff=request, after_a_step=own)
            else:
                sub = _Submission(list(request), params, None, future, q, group)
            subs.append(sub)
        self._enqueue(subs)
        return futures

    def _add_to_engine(self, sub: _Submission) -> int:
        """(step loop) The submission's request added to the engine (a prefill request, or a
        prefilled one admitted: `stream(..., handoff=)` too); its request id."""
        if sub.handoff is not None:
            return self.engine.admit_prefilled(sub.handoff, sub.params, sub.stop_check)
        if not sub.prefill:
            return self.engine.add_request(sub.prompt_ids, sub.params, sub.stop_check)
        pending = start_prefill(self.engine, sub.prompt_ids, sub.params)
        self._prefills[pending.request_id] = pending
        return pending.request_id

    def _resolve_prefill(self, request_id: int, future: Future) -> bool:
        """(step loop) A finished prefill request's future gets its handoff; False for others."""
        pending = self._prefills.pop(request_id, None)
        if pending is None:
            return False
        try:
            future.set_result(pending.handoff(self.engine))
        except RuntimeError as exc:  # aborted before its first token
            future.set_exception(EngineUnavailable(str(exc)))
        return True


class AsyncEngine(_PrefillDecodeRequests):
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
        self._groups: dict[int, tuple[_Quota, int]] = {}  # request id -> its quota, group
        self._prefills: dict[int, PendingPrefill] = {}  # prefill requests: their captures
        self._after_a_step: list[_Submission] = []  # admitted at the next pass of the loop
        self._streams = _Streams()
        self._cancels: list[Future] = []
        self._holds = 0  # callers holding the step loop parked between two steps
        self._parked = False
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
        self,
        requests: Seq[tuple[Seq[int], SamplingParams]],
        stop_check: StopCheck | None = None,
        *,
        groups: Seq[int] | None = None,
        quota: int | None = None,
    ) -> list[Future[GenerationResult]]:
        """Queue several requests at once, as `submit` does each: the step loop admits them
        together, in order, as `Engine.generate` does, so the batches they are computed in do
        not depend on thread timing (nor do the prefix-cache hits between them).

        With `groups` (one group id per request) and `quota`, the rest of the batch is aborted
        once `quota` groups are complete (module doc); `self.complete_groups(futures)` then
        gives those groups in completion order."""
        futures: list[Future] = [Future() for _ in requests]
        q = quota_of(futures, groups, quota)
        self._enqueue(
            [
                _Submission(list(prompt_ids), params, stop_check, future, q, groups[k] if q else 0)
                for k, ((prompt_ids, params), future) in enumerate(zip(requests, futures))
            ]
        )
        return futures

    def _enqueue(self, submissions: list[_Submission]) -> None:
        with self._cond:
            if self._failure is not None:
                raise EngineUnavailable(f"engine step loop failed: {self._failure!r}")
            if self._stopping:
                raise EngineUnavailable("engine is closed")
            if not self._open:
                raise EngineUnavailable("engine is updating weights; retry")
            self._inbox.extend(submissions)
            self._in_flight += len(submissions)
            self._cond.notify_all()

    @staticmethod
    def complete_groups(futures: Seq[Future]) -> Future[list[int]]:
        """For the futures of one `submit_many` call with a quota: a future of the groups that
        completed within the quota, in completion order (all of them if fewer completed)."""
        return futures[0].quota.complete  # type: ignore[attr-defined]

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

    async def stream(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        stop_check: StopCheck | None = None,
        handoff: PrefillHandoff | None = None,
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """One request whose tokens arrive as they are sampled: `TokenDelta`s (per sample, in
        order; each sample's last one has its finish reason), then the `GenerationResult`.
        Closing the iterator early (a client gone) aborts the request in the engine."""
        queue, listener = _thread_to_loop_queue()
        future: Future = Future()
        future.add_done_callback(lambda f: f.exception() and listener(f.exception()))
        sub = _Submission(list(prompt_ids), params, stop_check, future, None, 0, listener)
        self._enqueue([sub._replace(handoff=handoff)])
        try:
            while not isinstance(item := await queue.get(), GenerationResult):
                if isinstance(item, BaseException):  # refused at admission, or its step failed
                    raise item
                yield item
            yield item
        finally:
            if not future.done():  # a client gone early: abort the request
                self.cancel(future)

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

    # -- weight updates between steps (requests kept) ------------------------------------------
    def hold(self, timeout: float | None = None) -> None:
        """Park the step loop between two forward passes and return once it is parked; requests
        in flight stay in the engine with their K/V (nothing is drained or aborted). Until the
        matching `unhold()` the caller may update the engine's weights with `keep_running=True`.
        Submissions are still accepted (admitted after `unhold`)."""
        with self._cond:
            if self._stopping or self._failure is not None:
                raise EngineUnavailable("engine is closed")
            self._holds += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._parked, timeout):
                self._holds -= 1
                self._cond.notify_all()
                raise TimeoutError(f"the step loop did not park within {timeout} s")

    def unhold(self) -> None:
        with self._cond:
            if self._holds == 0:
                raise RuntimeError("unhold() without a hold()")
            self._holds -= 1
            self._cond.notify_all()

    def update_weights_between_steps(self, named_tensors) -> int:
        """`Engine.update_weights(named_tensors, keep_running=True)` applied between two forward
        passes (any thread, never during one); returns the new `weight_version`. Running
        requests continue with the new weights on their old K/V; the prefix cache never serves
        old-weight K/V to a request admitted afterwards."""
        self.hold()
        try:
            self.engine.update_weights(named_tensors, keep_running=True)
            return self.engine.weight_version
        finally:
            self.unhold()

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
                self._cond.wait_for(
                    lambda: self._stopping or self._holds > 0 or self._in_flight > 0
                )
                if self._stopping:
                    return
                if self._holds > 0:  # between two steps: a holder changes the weights now
                    self._parked = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._stopping or self._holds == 0)
                    self._parked = False
                    continue
                new = list(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, []
                abort = self._abort_all
            later, self._after_a_step = self._after_a_step, []
            for sub in later + new:
                if sub.after_a_step:
                    self._after_a_step.append(sub._replace(after_a_step=False))
                else:
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
            if self._streams.by_request:
                self._streams.progress(self.engine.scheduler)
            by_quota: dict[int, tuple[_Quota, list[int]]] = {}
            for out in finished:
                future = self._futures.pop(out.request_id)
                q, group = self._groups.pop(out.request_id, (None, 0))
                if q is not None:
                    q.request_ids.discard(out.request_id)
                    by_quota.setdefault(id(q), (q, []))[1].append(group)
                if self._resolve_prefill(out.request_id, future):
                    self._resolved(1)
                    continue
                result = GenerationResult.of(out, self.engine.weight_version)
                self._streams.finished(out.request_id, result)
                future.set_result(result)
                self._resolved(1)
            for q, groups_now in by_quota.values():
                for request_id in q.finished(groups_now) or ():
                    self.engine.abort(request_id)  # takes effect at the next step

    def _add(self, sub: _Submission) -> None:
        if not sub.future.set_running_or_notify_cancel():  # cancelled while queued
            if sub.quota is not None:
                sub.quota.failed()
            self._resolved(1)
            return
        try:
            request_id = self._add_to_engine(sub)
        except Exception as exc:  # noqa: BLE001 -- the request's own error, e.g. too long
            sub.future.set_exception(exc)
            if sub.quota is not None:
                sub.quota.failed()
            self._resolved(1)
            return
        self._futures[request_id] = sub.future
        if sub.listener is not None:
            self._streams.add(request_id, sub.listener, sub.params.n)
        if sub.quota is not None:
            sub.quota.request_ids.add(request_id)
            self._groups[request_id] = (sub.quota, sub.group)
            if sub.quota.reached:  # reached before it was admitted (`after_a_step`)
                self.engine.abort(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        """A step raised: every in-flight request fails with it. The engine's requests are
        aborted so it can serve again; if even that fails, the AsyncEngine refuses from now on."""
        futures, self._futures = self._futures, {}
        self._streams.by_request.clear()  # their futures' exceptions end them
        for request_id in self._prefills:
            self.engine.scheduler.exports.pop(request_id, None)
        self._prefills.clear()
        for request_id in futures:
            self.engine.abort(request_id)
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException as again:  # noqa: BLE001
            with self._cond:
                self._failure = again
        groups, self._groups = self._groups, {}
        for q, _ in groups.values():
            q.failed()
        for future in futures.values():
            future.set_exception(exc)
        self._resolved(len(futures))

    def _resolved(self, count: int) -> None:
        with self._cond:
            self._in_flight -= count
            self._cond.notify_all()


@contextlib.contextmanager
def held_open(engine: AsyncEngine):
    """The serving window open for the block (a batch call's requests admitted together, no
    update landing between them), closed again afterwards only if it was closed before."""
    was_open = engine.is_open
    engine.resume()
    try:
        yield engine
    finally:
        if not was_open:
            engine.pause()


def _thread_to_loop_queue() -> tuple[asyncio.Queue, StreamListener]:
    """A queue of the running event loop, and a listener any thread may put items into it with
    (a no-op once that loop is closed: nobody is listening)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    with _HANDOFFS_LOCK:
        handoff = _HANDOFFS.get(loop)
        if handoff is None:
            handoff = _HANDOFFS[loop] = _LoopHandoff(loop)

    def listener(item) -> None:
        handoff.put(queue, item)

    return queue, listener


class _LoopHandoff:
    """Items from other threads into one event loop's queues, the loop woken once per burst:
    the step loop hands every stream its delta after each step, and one wake-up (a write to the
    loop's self-pipe and a callback) then delivers them all, not one per stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # the registry's value must not keep its key alive
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []

    def put(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a delivery is already scheduled and not yet run
                return
        loop = self._loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_HANDOFFS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopHandoff] = (
    weakref.WeakKeyDictionary()
)
_HANDOFFS_LOCK = threading.Lock()
