"""Continuous batching over the paged KV pool and the radix prefix cache.

Each step:
1. every running sequence gets pages for the tokens it computes this step, oldest first
   (decoding ones: one token, plus its draft under speculation; a partly prefilled one: its next
   chunk). When pages run out the allocator evicts unlocked cache leaves (LRU) and drops parked
   K/V, then the scheduler preempts the newest running sequence (its pages are freed and it is
   requeued to be recomputed; its tokens, logprobs and generator are kept, so preemption does
   not change what it samples);
2. waiting sequences are admitted in arrival order while the chunked-prefill token budget,
   the running-request limit and the pages (with one step of decode headroom) allow; each first
   reuses the longest cached prefix of its tokens (never the last token, whose logits are needed)
   or the parked K/V it continues;
3. after the forward pass (`finish_step`), sequences that completed their prompt are inserted into
   the cache and fork into their `n` samples, which share the prompt's pages (without the cache,
   through a tree of their own: a request's samples always share one prefill); drafts are verified;
   every sequence with fresh logits samples one token; finished sequences leave at once, and their
   KV is offered to the cache.

The scheduler composes three managers: `PageAllocator` (pages.py: pages, slot-table rows, the
prefix cache), `ParkedKVStore` (parked.py) and, under speculation, `Drafting`
(rollout.speculative.drafting).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rollout.handoff import HandoffCapture, PrefillHandoff
from rollout.kv_pool import KVPool
from rollout.logprobs import LogprobOutputs
from rollout.radix_cache import RadixCache
from rollout.sampler import SamplingBatch, read_back, sample
from rollout.scheduler.pages import PageAllocator
from rollout.scheduler.parked import ParkedKV, ParkedKVStore
from rollout.scheduler.stats import SchedulerStats
from rollout.sequence import Request, RequestOutput, Sequence, Status
from rollout.speculative.drafting import Drafting, Emitted, Speculation


class ScheduledBatch(NamedTuple):
    decode: list[Sequence]  # each computes its one pending token (and its draft, if any)
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass
class Scheduler:
    pool: KVPool
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int
    enable_prefix_cache: bool
    eos_token_ids: frozenset[int]
    speculation: Speculation | None = None  # speculative decoding when set
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    weight_version: int = 0  # recorded with every token sampled (the engine sets it)
    # K, V of slots, every KV head (a prefill handoff's); None: the pool's `read_slots`. A
    # tensor-parallel engine gathers its ranks' heads.
    read_kv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        self.page_size = self.pool.page_size
        self.parked_kv = ParkedKVStore(self.pool, self.stats)
        self.allocator = PageAllocator(
            self.pool,
            self.max_running_requests,
            self.max_model_len,
            self.enable_prefix_cache,
            self.parked_kv,
            self.stats,
        )
        self.drafting = Drafting(self.speculation, self.stats) if self.speculation else None
        self.slot_table = self.allocator.slot_table
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        # `running` as it was when last sorted oldest first, and that order (steady decode
        # steps run the same sequences: no sort)
        self._sorted_from: list[Sequence] = []
        self._sorted: list[Sequence] = []
        self.requests: dict[int, Request] = {}  # unfinished requests
        # Those of `requests` whose last sample was recorded (`_record`), for `pop_finished`:
        # finding them there would test every unfinished request at every step.
        self._done: list[Request] = []
        self.logprob_outputs = LogprobOutputs()  # top-k and prompt log-probs, when asked
        # Prefill-decode disaggregation (`rollout.prefill_decode`). Prefill side: the requests
        # whose handoff is collected as their samples finish. Decode side: prefilled requests
        # waiting for rows and pages, admitted first at the next `schedule`.
        self.exports: dict[int, HandoffCapture] = {}
        self.prefilled: deque[tuple[Request, PrefillHandoff]] = deque()

    @property
    def cache(self) -> RadixCache | None:
        """The prefix cache (a new tree after each weight update while sequences ran)."""
        return self.allocator.cache

    @property
    def parked(self) -> list[ParkedKV]:
        """Parked K/V, oldest first (`rollout.scheduler.parked`)."""
        return self.parked_kv.entries

    # -- requests ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request: one sequence standing for its `n` samples, which share one prefill
        of the prompt and fork when it completes (with or without the prefix cache)."""
        self.requests[request.request_id] = request
        self.logprob_outputs.added(request)
        request.set_limits(self.eos_token_ids, self.max_model_len)
        self.waiting.append(Sequence(request, 0, num_forks=request.params.n))

    def abort(self, request_id: int) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.aborted = True
        for entry in [e for e in self.prefilled if e[0] is request]:
            self.prefilled.remove(entry)
            # Its first tokens are sampled (by the prefill engine): where there is room it ends
            # with them, as a request aborted after its first step does (below: a `park_kv` one
            # parks its K/V); else with none.
            if not (self._room_for_prefilled(request) and self._admit_prefilled(*entry)):
                self._record(Sequence(request, 0, num_forks=request.params.n), "abort")
        for seq in [s for s in self.waiting if s.request is request]:
            self.waiting.remove(seq)
            self._record(seq, "abort")
        park = request.params.park_kv
        for seq in [s for s in self.running if s.request is request]:
            if park and seq.num_forks == 1 and seq.num_generated > 0:  # its K/V waits
                self.allocator.keep_routes(seq)
                self.parked_kv.park(seq)
                self.allocator.return_rows(seq)
                self.running.remove(seq)
            else:
                self._release(seq, cache_kv=False)
            self._record(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def pop_finished(self) -> list[RequestOutput]:
        """The requests whose every sample ended since the last call, in request order (the
        order of `requests`: ids are assigned in arrival order)."""
        done = sorted({r.request_id: r for r in self._done}.values(), key=lambda r: r.request_id)
        self._done = []
        for r in done:
            del self.requests[r.request_id]
            self.logprob_outputs.finished(r)
        return [r.output() for r in done]

    def new_weights(self) -> int:
        """The model's weights changed (`PageAllocator.new_weights`: running sequences and parked
        K/V keep theirs); returns the pages freed."""
        return self.allocator.new_weights([*self.running, *self.parked])

    def drop_parked(self, count: int | None = None) -> int:
        """Free the oldest `count` parked entries (all by default); returns the pages freed."""
        return self.parked_kv.drop(count)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        while self.prefilled and self._admit_prefilled(*self.prefilled[0]):
            self.prefilled.popleft()
        decode: list[Sequence] = []
        prefill: list[tuple[Sequence, int]] = []
        budget, page_size, allocator = self.max_prefill_tokens, self.page_size, self.allocator
        # Oldest first: a victim (the newest) is then never one already scheduled this step.
        if self.running != self._sorted_from:  # identity, element by element
            self._sorted_from = list(self.running)
            self._sorted = sorted(self.running, key=lambda s: s.order)
        running = self._sorted
        if self.drafting is not None:
            self.drafting.draft([s for s in running if len(s.token_ids) - s.num_computed == 1])
        evicted = False
        for i, seq in enumerate(running):
            if seq.status is not Status.RUNNING:  # preempted by an older sequence this step
                continue
            pending = len(seq.token_ids) - seq.num_computed
            if pending == 1 and not seq.draft and seq.num_computed < len(seq.pages) * page_size:
                decode.append(seq)  # most decode steps: its last page has room (`reserve`)
                continue
            num_new = 1 + len(seq.draft) if pending == 1 else min(pending, budget)
            if not evicted and (count := allocator.pages_for(seq, num_new)) > (
                self.pool.num_free_pages
            ):
                allocator.evict_for_step(count, running[i + 1 :])
                evicted = True
            if num_new == 0 or not allocator.reserve(seq, num_new, self._preempt_newest):
                continue
            if pending == 1:
                decode.append(seq)
            else:
                prefill.append((seq, num_new))
                budget -= num_new
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            pending = len(seq.token_ids) - seq.num_computed
            num_new = min(pending, budget)
            reserved = allocator.reserve(seq, num_new, self._preempt_newest)
            assert reserved, "admission checked that the pages are available"
            if pending == 1:
                decode.append(seq)
            else:
                prefill.append((seq, num_new))
            budget -= num_new
        return ScheduledBatch(decode, prefill)

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Take rows and the K/V `seq` can reuse, with pages checked for its first `budget`
        tokens; False (and nothing taken) if it does not fit this step."""
        if len(self.allocator.free_rows) < seq.num_forks:
            return False
        # Headroom: one page for every sequence that decodes next step (forks included). With
        # nothing running there is nothing to protect, and admitting guarantees progress.
        headroom = len(self.running) + seq.num_forks if self.running else 0
        if not self.allocator.take_prefix(seq, budget, headroom):
            if not self.running and self.parked:  # parked K/V must not stall the engine
                self.drop_parked()
                return self._admit(seq, budget)
            return False
        if seq.request.cached_tokens is None:  # a re-admission after preemption is not a hit
            seq.request.cached_tokens = seq.num_computed
        self.allocator.take_rows(seq)
        seq.status = Status.RUNNING
        seq.new_kv_epoch()
        self.allocator.write_pages(seq)
        self.running.append(seq)
        return True

    def add_prefilled(self, request: Request, handoff: PrefillHandoff) -> None:
        """Queue a request whose prompt another engine computed (`handoff`); it is admitted with
        that K/V at the next `schedule` that has rows and pages for it."""
        self.requests[request.request_id] = request
        self.logprob_outputs.added(request)
        request.set_limits(self.eos_token_ids, self.max_model_len)
        request.cached_tokens = handoff.cached_tokens
        self.prefilled.append((request, handoff))

    def _prefilled_pages(self, request: Request) -> int:
        """The pages admitting a prefilled request takes: the prompt's (once: its samples fork
        from it), and one per sample for its tail page copy or its next token."""
        return -(-len(request.prompt) // self.page_size) + request.params.n

    def _room_for_prefilled(self, request: Request) -> bool:
        return len(self.allocator.free_rows) >= request.params.n and (
            self.allocator.available_pages() >= self._prefilled_pages(request)
        )

    def _admit_prefilled(self, request: Request, handoff: PrefillHandoff) -> bool:
        """Admit a prefilled request: pages with the handoff's K/V copied in (the prefix cache
        keeps its whole pages, or its own where it had them), its samples forked, each given
        its first token and a uniform stream past the draws the prefill consumed. They decode
        from this step on. False (nothing taken) if rows or pages are short."""
        if not self._room_for_prefilled(request):
            if not self.running:
                raise RuntimeError(
                    f"a prefilled request needs {self._prefilled_pages(request)} KV pages and "
                    f"{request.params.n} rows with nothing running; raise kv_cache_tokens or "
                    "max_running_requests"
                )
            return False
        seq = Sequence(request, 0, num_forks=request.params.n)  # as `add`
        prompt_len = len(request.prompt)
        pool = self.pool
        pages = self.allocator.alloc(-(-prompt_len // self.page_size))
        assert pages is not None, "counted as available"
        seq.pages, seq.tree, seq.status = pages, self.cache, Status.RUNNING
        self.allocator.take_rows(seq)
        seq.new_kv_epoch()
        self.allocator.write_pages(seq)
        slots = self.slot_table[seq.row, :prompt_len]
        # quantized if the pool is FP8; under tensor parallelism each rank keeps its heads
        pool.write_slots(slots, handoff.k, handoff.v)
        if pool.routes is not None and handoff.routes is not None:
            pool.routes.index_copy_(0, slots, handoff.routes.to(pool.device, pool.routes.dtype))
        seq.num_computed = prompt_len
        self.running.append(seq)
        forks = self._ready_to_sample(seq)
        version = self.weight_version
        for seq in forks:
            j = seq.sample_index
            seq.uniforms.skip(handoff.uniforms_taken[j])
            reason = seq.append([handoff.first_tokens[j]], [handoff.first_logprobs[j]], version)
            if reason is not None:
                self._finish(seq, reason)
        return True

    def _preempt_newest(self) -> Sequence:
        """Preempt the newest running sequence (pages ran out); returns it."""
        victim = max(self.running, key=lambda s: s.order)
        self._release(victim, cache_kv=False)
        victim.draft, victim.draft_probs = [], None
        victim.status = Status.WAITING
        victim.num_computed = 0
        # Victims are taken newest first, so pushing each to the front keeps arrival order.
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        return victim

    def _release(self, seq: Sequence, cache_kv: bool) -> None:
        self.allocator.release(seq, cache_kv)
        self.running.remove(seq)

    # -- after the forward pass ----------------------------------------------------------------
    def finish_step(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Advance the batch's sequences. `logits` rows: one per decode token (pending token then
        drafts, per sequence), then one per prefill that reached its sequence's last token."""
        self.stats.decode_steps += 1 if batch.decode else 0
        to_sample: list[Sequence] = []
        logit_rows: list[int] = []
        row = 0
        speculated: list[tuple[Sequence, int]] = []  # (sequence, its first logits row)
        drafting = self.drafting is not None  # else no sequence ever holds a draft
        for seq in batch.decode:
            if drafting and seq.draft:  # only decoding samples draft: no prompt token here
                speculated.append((seq, row))
                row += 1 + len(seq.draft)
                continue
            seq.num_computed = computed = seq.num_computed + 1
            # a decoding sample (its one pending token was sampled: num_generated > 0), the
            # common case: nothing to share
            if computed > seq.prompt_len and seq.num_forks == 1:
                to_sample.append(seq)
                logit_rows.append(row)
            else:
                if computed <= seq.prompt_len:  # the prompt's last token (the rest was cached)
                    self.stats.prefill_tokens_computed += 1
                for s in self._ready_to_sample(seq):
                    to_sample.append(s)
                    logit_rows.append(row)
            row += 1
        emitted: list[Emitted] = self.drafting.verify(speculated, logits) if speculated else []
        tops = self.logprob_outputs.emitted(emitted, speculated, logits)
        for seq, num_new in batch.prefill:
            row += self.logprob_outputs.prompt_chunk(seq, num_new, logits, row)
            seq.num_computed += num_new
            self.stats.prefill_tokens_computed += num_new
            if seq.num_computed == len(seq.token_ids):
                for s in self._ready_to_sample(seq):
                    to_sample.append(s)
                    logit_rows.append(row)
                row += 1
        assert row == logits.shape[0], "logits rows do not match the batch"
        sampled = ()
        if to_sample:
            # Rows 0, 1, ... each sampled once (a pure decode step): the logits as they are.
            if logit_rows != list(range(logits.shape[0])):
                logits = logits[torch.tensor(logit_rows, device=logits.device)]
            tokens, logprobs = sample(logits, SamplingBatch.of(to_sample))
            sampled = zip(to_sample, *read_back(tokens, logprobs))
            self.logprob_outputs.sampled(to_sample, logits)
        version = self.weight_version
        for i, (seq, tokens, logprobs) in enumerate(emitted):
            before = len(seq.token_ids)
            reason = seq.append(tokens, logprobs, version, tops[i] if tops else None)
            self.stats.generated_tokens += len(seq.token_ids) - before
            if reason is not None:
                self._finish(seq, reason)
        # `Sequence.append` of one token, inline: this loop runs for every sampled token of
        # every step, and a call per token costs more than the rest of it. `finish_reason`
        # still decides every finish; the test in front of it only skips the call where no stop
        # is possible (not a stop id, short of the end, no stop check).
        for seq, token, logprob in sampled:
            ids, request = seq.token_ids, seq.request
            ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if token in request.stop_ids or len(ids) >= request.end_len or request.stop_check:
                if (reason := seq.finish_reason(token)) is not None:
                    self._finish(seq, reason)
        self.stats.generated_tokens += len(to_sample)

    def _finish(self, seq: Sequence, reason: str) -> None:
        # Stopping inside an accepted draft: K/V past the last kept token is not the sequence's.
        seq.num_computed = min(seq.num_computed, len(seq.token_ids))
        if self.exports and (capture := self.exports.get(seq.request.request_id)) is not None:
            capture.take(seq, self.pool, self.slot_table, self.read_kv)  # before pages go back
        if seq.status is Status.RUNNING:
            self._release(seq, cache_kv=True)
        else:  # a fork that found no page: it never held KV
            self.waiting.remove(seq)
        self._record(seq, reason)

    def _ready_to_sample(self, seq: Sequence) -> list[Sequence]:
        """`seq` has computed all its tokens. A completed prompt (via a prefill chunk or, fully
        cached but its last token, a decode) is first shared through the cache (or, without
        one, through a tree only its forks hold), then forks."""
        if seq.num_generated == 0:
            self.allocator.share_completed_prompt(seq)
        return self._fork(seq)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The samples that draw from `seq`'s fresh logits: itself, plus its forks the first time
        its prompt completes (`PageAllocator.share_prompt`; a fork that finds no free page waits
        to recompute its tail instead)."""
        if seq.num_forks == 1:
            return [seq]
        forks = [seq]
        for j in range(1, seq.num_forks):
            child = Sequence(seq.request, j, token_ids=list(seq.token_ids))
            forks.append(child)
            if self.cache is not None:  # without the cache nothing counts as a cache hit
                self.stats.prefix_cache_hit_tokens += seq.num_computed
            if self.allocator.share_prompt(seq, child):
                child.status = Status.RUNNING
                self.running.append(child)
            else:
                self.waiting.appendleft(child)
        seq.num_forks = 1
        return forks

    def _record(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        self.allocator.keep_routes(seq)
        if reason != "abort":
            self.stats.finished_samples += seq.num_forks
        if self.drafting is not None:
            self.drafting.forget(seq)
        seq.request.record(seq, reason)
        if seq.request.done:
            self._done.append(seq.request)

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every manager's invariants (pages and rows: free + cached + in use == total, each in
        exactly one place), and each sequence's status matching where it is."""
        self.allocator.check_integrity(self.running, self.parked)
        self.parked_kv.check_integrity()
        for seq in self.running:
            assert seq.status is Status.RUNNING
        for seq in self.waiting:
            assert seq.status is Status.WAITING and not seq.pages and seq.row is None
        if self.drafting is not None:
            self.drafting.check_integrity([*self.running, *self.waiting])
