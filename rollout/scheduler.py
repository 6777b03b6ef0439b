"""Continuous batching over the paged KV pool and the radix prefix cache.

Each step:
1. every running sequence gets pages for the tokens it computes this step, oldest first
   (decoding ones: one token; a partly prefilled one: its next chunk). When pages run out the
   scheduler evicts unlocked cache leaves (LRU), then preempts the newest running sequence
   (its pages are freed and it is requeued to be recomputed; its tokens, logprobs and generator
   are kept, so preemption does not change what it samples);
2. waiting sequences are admitted in arrival order while the chunked-prefill token budget,
   the running-request limit and the pages (with one step of decode headroom) allow; each first
   reuses the longest cached prefix of its tokens (never the last token, whose logits are needed);
3. after the forward pass (`finish_step`), sequences that completed their prompt are inserted into
   the cache and fork into their `n` samples, which share the prompt's pages; every sequence
   with fresh logits samples one token; finished sequences leave at once, and their KV is
   offered to the cache.

Parked K/V (`SamplingParams.park_kv`, over-sampling's `partial: in_place`): a sample aborted
mid-generation keeps its pages (and its lock on the tree path) in `parked` instead of freeing
them; a later `park_kv` request whose prompt is exactly that sample's tokens adopts them and
computes only what was pending. Parked K/V outlives weight updates (its tree is retired, never
matched by others): that is what `in_place` keeps. It is dropped, oldest first, before any
running sequence is preempted, and when the engine flushes its cache or releases memory; the
continuation then prefills (as `retract` does).

The slot table maps (row, position) -> KV slot for every admitted sequence: the model runner
reads attention indices from it, so per-step metadata is a few tensor gathers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from rollout.kv_pool import KVPool, write_page_slots
from rollout.radix_cache import RadixCache, TreeNode
from rollout.sampler import SamplingBatch, sample
from rollout.sequence import Request, RequestOutput, SampleOutput, Sequence, Status
from rollout.speculative import NO_DRAFT, Draft, DraftBackoff, verify


class DraftProposer(Protocol):
    """What the scheduler needs from a speculative proposer (lookup or draft model)."""

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]: ...
    def forget(self, seq: Sequence) -> None: ...


class ParkedKV(NamedTuple):
    """The K/V of an aborted `park_kv` sample, kept for its continuation."""

    tokens: tuple[int, ...]  # prompt + generated tokens (the last one pending, not computed)
    num_computed: int
    pages: list[int]  # page table; the first `num_tree_pages` belong to `tree`
    num_tree_pages: int
    node: TreeNode | None  # locked in `tree`
    tree: RadixCache | None

    @property
    def private_pages(self) -> list[int]:
        return self.pages[self.num_tree_pages :]


class ScheduledBatch(NamedTuple):
    decode: list[Sequence]  # each computes its one pending token
    prefill: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass
class SchedulerStats:
    prefill_tokens_computed: int = 0
    prefix_cache_hit_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    evicted_tokens: int = 0
    spec_verify_steps: int = 0  # sequence-steps that verified a non-empty draft
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_backoff_steps: int = 0  # sequence-steps that skipped drafting after failed drafts
    finished_samples: int = 0  # samples that ended by a stop or the length limit (not aborts)
    parked_reused_tokens: int = 0  # tokens of parked K/V a continuation adopted
    parked_dropped_tokens: int = 0  # tokens of parked K/V dropped (memory, flush, release)
    # tokens of running sequences whose K/V a weight update kept (`keep_running`): not
    # prefilled again under the new weights
    in_place_kept_tokens: int = 0


@dataclass
class Scheduler:
    pool: KVPool
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int
    enable_prefix_cache: bool
    eos_token_ids: frozenset[int]
    proposer: DraftProposer | None = None  # speculative decoding when set
    num_speculative_tokens: int = 0
    speculative_min_acceptance: float = 0.0  # see DraftBackoff
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    weight_version: int = 0  # recorded with every token sampled (the engine sets it)

    def __post_init__(self) -> None:
        self.page_size = self.pool.page_size
        self.cache = (
            RadixCache(self.page_size, self.pool.free_pages) if self.enable_prefix_cache else None
        )
        # Trees retired by weight updates while sequences ran (`new_weights`), kept while a
        # running sequence still holds a path in them.
        self.retired_caches: list[RadixCache] = []
        self.parked: list[ParkedKV] = []  # oldest first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        # `running` as it was when last sorted oldest first, and that order (steady decode
        # steps run the same sequences: no sort)
        self._sorted_from: list[Sequence] = []
        self._sorted: list[Sequence] = []
        self.requests: dict[int, Request] = {}  # unfinished requests
        self.slot_table = torch.zeros(
            (self.max_running_requests, self.max_model_len),
            dtype=torch.int64,
            device=self.pool.device,
        )
        self._free_rows = list(range(self.max_running_requests - 1, -1, -1))

    # -- requests ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request. With the prefix cache its samples share one prefill (fork); without
        it each sample is its own sequence and prefills the prompt itself."""
        self.requests[request.request_id] = request
        params = request.params
        eos = self.eos_token_ids if not params.ignore_eos else frozenset()
        request.stop_ids = eos | frozenset(params.stop_token_ids)
        request.end_len = min(len(request.prompt) + params.max_new_tokens, self.max_model_len)
        n = params.n
        if self.cache is not None:
            self.waiting.append(Sequence(request, 0, num_forks=n))
        else:
            self.waiting.extend(Sequence(request, j) for j in range(n))

    def abort(self, request_id: int) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.aborted = True
        for seq in [s for s in self.waiting if s.request is request]:
            self.waiting.remove(seq)
            self._record(seq, "abort")
        park = request.params.park_kv
        for seq in [s for s in self.running if s.request is request]:
            if park and seq.num_forks == 1 and seq.num_generated > 0:
                self._park(seq)
            else:
                self._release(seq, cache_kv=False)
            self._record(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def pop_finished(self) -> list[RequestOutput]:
        done = [r for r in self.requests.values() if r.done]
        for r in done:
            del self.requests[r.request_id]
        return [
            RequestOutput(
                r.request_id, r.prompt, list(r.samples), r.cached_tokens or 0, tuple(r.versions)
            )
            for r in done
        ]

    def new_weights(self) -> int:
        """The model's weights changed: no K/V cached under the old ones may serve a sequence
        admitted from now on. Idle, the cache is flushed. With sequences running, their K/V
        stays theirs (`in_place`), the tree they hold is retired (`RadixCache.retire`) and a
        new one caches from now on; they never insert into the new one. Returns the pages
        freed."""
        if self.cache is None:
            return 0
        if not self.running and not self.parked and not self.cache.locked_pages:
            self.retired_caches = []  # nothing holds them: their pages are back in the pool
            return self.cache.reset()
        freed = self.cache.retire()
        holders = [*self.running, *self.parked]
        self.retired_caches = [
            t for t in [*self.retired_caches, self.cache] if any(h.tree is t for h in holders)
        ]
        self.cache = RadixCache(self.page_size, self.pool.free_pages)
        return freed

    # -- parked K/V ----------------------------------------------------------------------------
    def _park(self, seq: Sequence) -> None:
        """Abort `seq` keeping its pages and tree lock for a continuation (module doc)."""
        self.parked.append(
            ParkedKV(
                tuple(seq.token_ids),
                seq.num_computed,
                list(seq.pages),
                seq.num_tree_pages,
                seq.node,
                seq.tree,
            )
        )
        seq.pages, seq.num_tree_pages, seq.node, seq.tree = [], 0, None, None
        self._free_rows.append(seq.row)
        self._free_rows.extend(seq.extra_rows)
        seq.row, seq.extra_rows = None, []
        seq.draft, seq.draft_probs = [], None
        seq.new_kv_epoch()
        self.running.remove(seq)

    def _find_parked(self, seq: Sequence) -> ParkedKV | None:
        if not self.parked or not seq.request.params.park_kv or seq.num_forks != 1:
            return None
        tokens = tuple(seq.token_ids)
        return next((p for p in self.parked if p.tokens == tokens), None)

    def drop_parked(self, count: int | None = None) -> int:
        """Free the oldest `count` parked entries (all by default); returns the pages freed."""
        drop = self.parked[:count] if count is not None else list(self.parked)
        del self.parked[: len(drop)]
        freed = 0
        for p in drop:
            if p.node is not None:
                p.tree.unlock(p.node)
            self.pool.free_pages(p.private_pages)
            freed += len(p.private_pages)
            self.stats.parked_dropped_tokens += p.num_computed
        return freed

    # -- pages ---------------------------------------------------------------------------------
    def _available_pages(self) -> int:
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        parked = sum(len(p.private_pages) for p in self.parked)  # tree pages: maybe shared
        return self.pool.num_free_pages + evictable + parked

    def _alloc(self, count: int) -> list[int] | None:
        pages = self.pool.alloc_pages(count)
        while pages is None:
            if self.cache is not None:
                freed = self.cache.evict(count - self.pool.num_free_pages)
                self.stats.evicted_tokens += freed * self.page_size
                pages = self.pool.alloc_pages(count)
            if pages is not None or not self.parked:
                break
            self.drop_parked(1)  # before any running sequence is preempted
            pages = self.pool.alloc_pages(count)
        return pages

    def _pages_for(self, seq: Sequence, num_new: int) -> int:
        """New pages `seq` needs to hold K/V for `num_new` more tokens."""
        needed = -(-(seq.num_computed + num_new) // self.page_size)
        return max(0, needed - len(seq.pages))

    def _write_pages(self, seq: Sequence, first_page: int = 0) -> None:
        """Slot-table entries of seq's pages from `first_page` on. A page's slots are written once,
        when the page joins the sequence, so most decode steps write nothing."""
        write_page_slots(self.slot_table, seq.row, seq.pages, first_page, self.page_size)

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        """Give `seq` pages for `num_new` more tokens, evicting and then preempting the newest
        running sequences as needed. False if `seq` itself had to be preempted."""
        count = self._pages_for(seq, num_new)
        if count == 0:  # most decode steps: the last page has room
            return True
        while (pages := self._alloc(count)) is None:
            victim = max(self.running, key=lambda s: s.order)
            self._preempt(victim)
            if victim is seq:
                return False
        seq.pages.extend(pages)
        self._write_pages(seq, len(seq.pages) - len(pages))
        return True

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        decode: list[Sequence] = []
        prefill: list[tuple[Sequence, int]] = []
        budget, page_size = self.max_prefill_tokens, self.page_size
        # Oldest first: a victim (the newest) is then never one already scheduled this step.
        if self.running != self._sorted_from:  # identity, element by element
            self._sorted_from = list(self.running)
            self._sorted = sorted(self.running, key=lambda s: s.order)
        running = self._sorted
        if self.proposer is not None:
            self._draft([s for s in running if len(s.token_ids) - s.num_computed == 1])
        evicted = False
        for i, seq in enumerate(running):
            if seq.status is not Status.RUNNING:  # preempted by an older sequence this step
                continue
            pending = len(seq.token_ids) - seq.num_computed
            if pending == 1 and not seq.draft and seq.num_computed < len(seq.pages) * page_size:
                decode.append(seq)  # most decode steps: its last page has room (`_reserve`)
                continue
            num_new = 1 + len(seq.draft) if pending == 1 else min(pending, budget)
            if not evicted and (count := self._pages_for(seq, num_new)) > self.pool.num_free_pages:
                self._evict_for_step(count, running[i + 1 :])
                evicted = True
            if num_new == 0 or not self._reserve(seq, num_new):
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
            reserved = self._reserve(seq, num_new)
            assert reserved, "admission checked that the pages are available"
            if pending == 1:
                decode.append(seq)
            else:
                prefill.append((seq, num_new))
            budget -= num_new
        return ScheduledBatch(decode, prefill)

    def _evict_for_step(self, count: int, rest: list[Sequence]) -> None:
        """Evict, in one pass over the tree, what `count` pages and the decodes of `rest` need
        beyond the free pages. Decoding sequences cross page boundaries together (forks of a
        prompt in lockstep); evicting for each in turn (`_alloc`) walked the whole tree once per
        sequence."""
        if self.cache is None or not self.cache.evictable_pages:
            return
        need = count + sum(
            self._pages_for(s, 1 + len(s.draft))
            for s in rest
            if len(s.token_ids) - s.num_computed == 1
        )
        if need > self.pool.num_free_pages:
            freed = self.cache.evict(need - self.pool.num_free_pages)
            self.stats.evicted_tokens += freed * self.page_size

    def _draft(self, decoding: list[Sequence]) -> None:
        """Set `draft` / `draft_probs` of every decoding sequence: a speculated continuation, never
        past its token limits, or nothing (its first token, drawn at the fork; or backing off)."""
        ks = []
        for seq in decoding:
            if seq.backoff is None:
                seq.backoff = DraftBackoff(self.speculative_min_acceptance)
            room = (
                min(
                    seq.request.params.max_new_tokens - seq.num_generated,
                    self.max_model_len - len(seq.token_ids),
                )
                - 1
            )
            k = min(self.num_speculative_tokens, room) if seq.num_generated > 0 else 0
            if k > 0 and not seq.backoff.should_draft():
                self.stats.spec_backoff_steps += 1
                k = 0
            ks.append(k)
        drafts = (
            self.proposer.propose_batch(decoding, ks) if any(ks) else [NO_DRAFT] * len(decoding)
        )
        for seq, (tokens, probs) in zip(decoding, drafts):
            seq.draft, seq.draft_probs = tokens, probs

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Take rows, the cached prefix and check pages for `seq`; False (and nothing taken)
        if it does not fit this step."""
        if len(self._free_rows) < seq.num_forks:
            return False
        match = None
        parked = self._find_parked(seq)
        if parked is not None:
            cached, have = parked.num_computed, len(parked.pages)
            available = self._available_pages() - len(parked.private_pages)
        else:
            if self.cache is not None:
                match = self.cache.match_prefix(seq.token_ids[:-1])
                self.cache.lock(
                    match.node
                )  # before counting: the matched pages are no longer evictable
            cached = match.num_tokens if match else 0
            have = len(match.pages) if match else 0
            available = self._available_pages()
        num_new = min(len(seq.token_ids) - cached, budget)
        need = -(-(cached + num_new) // self.page_size) - have
        # Headroom: one page for every sequence that decodes next step (forks included). With
        # nothing running there is nothing to protect, and admitting guarantees progress.
        headroom = len(self.running) + seq.num_forks if self.running else 0
        if available < need + headroom:
            if match is not None:
                self.cache.unlock(match.node)
            if not self.running and self.parked:  # parked K/V must not stall the engine
                self.drop_parked()
                return self._admit(seq, budget)
            return False
        if parked is not None:
            self.parked.remove(parked)
            seq.node, seq.tree = parked.node, parked.tree
            seq.pages, seq.num_tree_pages = list(parked.pages), parked.num_tree_pages
            seq.num_computed = cached
            self.stats.parked_reused_tokens += cached
        elif match is not None:
            seq.node, seq.tree, seq.pages, seq.num_tree_pages = (
                match.node,
                self.cache,
                list(match.pages),
                len(match.pages),
            )
            seq.num_computed = cached
            self.stats.prefix_cache_hit_tokens += cached
        if seq.request.cached_tokens is None:  # a re-admission after preemption is not a hit
            seq.request.cached_tokens = cached
        seq.row = self._free_rows.pop()
        seq.extra_rows = [self._free_rows.pop() for _ in range(seq.num_forks - 1)]
        seq.status = Status.RUNNING
        seq.new_kv_epoch()
        self._write_pages(seq)
        self.running.append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq, cache_kv=False)
        seq.draft, seq.draft_probs = [], None
        seq.status = Status.WAITING
        seq.num_computed = 0
        # Victims are taken newest first, so pushing each to the front keeps arrival order.
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _release(self, seq: Sequence, cache_kv: bool) -> None:
        """Return seq's pages, lock and rows. With `cache_kv`, its computed K/V is offered to the
        prefix cache first (only whole pages are kept)."""
        # K/V from before a weight update (a retired tree) is never offered to the new cache.
        if cache_kv and self.cache is not None and seq.tree is self.cache:
            self._insert_into_cache(seq)
        if seq.node is not None:
            seq.tree.unlock(seq.node)
        self.pool.free_pages(seq.private_pages)
        seq.pages, seq.num_tree_pages, seq.node, seq.tree = [], 0, None, None
        self._free_rows.append(seq.row)
        self._free_rows.extend(seq.extra_rows)
        seq.row, seq.extra_rows = None, []
        seq.new_kv_epoch()
        self.running.remove(seq)

    def _insert_into_cache(self, seq: Sequence) -> None:
        """Insert the whole pages of seq's computed tokens into its tree (a retired one for a
        prompt prefilled across a weight update: only its own forks share it); afterwards seq's
        page table points at the tree's pages for them (its duplicates freed) and it locks the
        new deepest node."""
        tree = seq.tree
        num_full = seq.num_computed // self.page_size
        tokens = seq.token_ids[: num_full * self.page_size]
        already = tree.insert(tokens, seq.pages[:num_full]) // self.page_size
        duplicates = seq.pages[seq.num_tree_pages : already]
        self.pool.free_pages(duplicates)
        match = tree.match_prefix(tokens)
        tree.lock(match.node)
        if seq.node is not None:
            tree.unlock(seq.node)
        seq.pages = match.pages + seq.pages[num_full:]
        seq.num_tree_pages, seq.node = num_full, match.node
        seq.new_kv_epoch()  # the suffix now starts at another position (and maybe other pages)
        if duplicates:
            self._write_pages(seq)

    # -- after the forward pass ----------------------------------------------------------------
    def finish_step(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Advance the batch's sequences. `logits` rows: one per decode token (pending token then
        drafts, per sequence), then one per prefill that reached its sequence's last token."""
        self.stats.decode_steps += 1 if batch.decode else 0
        to_sample: list[Sequence] = []
        logit_rows: list[int] = []
        emitted: list[tuple[Sequence, list[int], list[float]]] = []
        row = 0
        speculated: list[tuple[Sequence, int]] = []  # (sequence, its first logits row)
        drafting = self.proposer is not None  # else no sequence ever holds a draft
        for seq in batch.decode:
            if drafting and seq.draft:
                if seq.num_computed < seq.prompt_len:
                    self.stats.prefill_tokens_computed += 1
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
        if speculated:
            rows = torch.cat([torch.arange(r, r + 1 + len(s.draft)) for s, r in speculated]).to(
                logits.device
            )
            seqs = [s for s, _ in speculated]
            for seq, result in zip(seqs, verify(logits[rows], seqs)):
                # KV is now valid for the pending token and the accepted drafts.
                self.stats.spec_verify_steps += 1
                self.stats.spec_draft_tokens += len(seq.draft)
                self.stats.spec_accepted_tokens += result.num_accepted
                seq.backoff.record(len(seq.draft), result.num_accepted)
                seq.num_computed += 1 + result.num_accepted
                seq.draft, seq.draft_probs = [], None
                emitted.append((seq, result.tokens, result.logprobs))
        for seq, num_new in batch.prefill:
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
            sampled = zip(to_sample, tokens.tolist(), logprobs.tolist())
        for seq, tokens, logprobs in emitted:
            self._append(seq, tokens, logprobs)
        version = self.weight_version
        for seq, token, logprob in sampled:  # `_append` of one token, inline (every step)
            ids, request = seq.token_ids, seq.request
            ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            # `_finish_reason` only where a stop is possible (its checks, inline)
            if token in request.stop_ids or len(ids) >= request.end_len or request.stop_check:
                if (reason := self._finish_reason(seq, token)) is not None:
                    self._finish(seq, reason)
        self.stats.generated_tokens += len(to_sample)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Append sampled tokens, stopping at the first that finishes the sequence."""
        for token, logprob in zip(tokens, logprobs):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            self.stats.generated_tokens += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                return

    def _finish(self, seq: Sequence, reason: str) -> None:
        # Stopping inside an accepted draft: K/V past the last kept token is not the sequence's.
        seq.num_computed = min(seq.num_computed, len(seq.token_ids))
        if seq.status is Status.RUNNING:
            self._release(seq, cache_kv=True)
        else:  # a fork that found no page: it never held KV
            self.waiting.remove(seq)
        self._record(seq, reason)

    def _ready_to_sample(self, seq: Sequence) -> list[Sequence]:
        """`seq` has computed all its tokens. A completed prompt (via a prefill chunk or, fully
        cached but its last token, a decode) is first shared through the cache, then forks."""
        if seq.num_generated == 0 and self.cache is not None:
            self._insert_into_cache(seq)
        return self._fork(seq)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The samples that draw from `seq`'s fresh logits: itself, plus its forks the first time
        its prompt completes. Forks lock the shared prompt pages and copy the partly filled last
        page, if any; a fork that finds no free page waits to recompute its tail instead."""
        if seq.num_forks == 1:
            return [seq]
        forks = [seq]
        tail = seq.num_computed % self.page_size
        for j in range(1, seq.num_forks):
            child = Sequence(seq.request, j, token_ids=list(seq.token_ids))
            forks.append(child)
            self.stats.prefix_cache_hit_tokens += seq.num_computed
            page = self._alloc(1) if tail else []
            if page is None:
                self.waiting.appendleft(child)
                self._free_rows.append(seq.extra_rows.pop())
                continue
            child.pages = seq.pages[: seq.num_tree_pages] + page
            child.num_tree_pages, child.node, child.tree = seq.num_tree_pages, seq.node, seq.tree
            seq.tree.lock(seq.node)
            if tail:
                self.pool.copy_page_prefix(seq.pages[-1], page[0], tail)
            child.num_computed = seq.num_computed
            child.row = seq.extra_rows.pop()
            child.status = Status.RUNNING
            child.new_kv_epoch()
            self._write_pages(child)
            self.running.append(child)
        seq.num_forks = 1
        return forks

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        request = seq.request
        if token in request.stop_ids:
            return "stop"
        if request.stop_check is not None and request.stop_check(seq.token_ids[seq.prompt_len :]):
            return "stop"
        return "length" if len(seq.token_ids) >= request.end_len else None

    def _record(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        if reason != "abort":
            self.stats.finished_samples += seq.num_forks
        if self.proposer is not None:
            self.proposer.forget(seq)
        out = SampleOutput(seq.token_ids[seq.prompt_len :], list(seq.logprobs), reason)
        seq.request.versions[seq.sample_index] = list(seq.versions)
        for j in range(seq.sample_index, seq.sample_index + seq.num_forks):
            seq.request.samples[j] = out if j == seq.sample_index else SampleOutput([], [], reason)

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + in use == total pages, each page in exactly one place; rows likewise."""
        free = self.pool.free_page_ids()
        direct_locks: dict[int, int] = {}
        for holder in [*self.running, *self.parked]:
            if holder.node is not None:
                direct_locks[id(holder.node)] = direct_locks.get(id(holder.node), 0) + 1
        trees = [self.cache, *self.retired_caches] if self.cache is not None else []
        cached = [p for t in trees for p in t.check_integrity(direct_locks)]
        for holder in [*self.running, *self.parked]:
            assert holder.tree is None or any(holder.tree is t for t in trees), "unknown tree"
        private = [p for s in [*self.running, *self.parked] for p in s.private_pages]
        everything = free + cached + private
        assert len(everything) == self.pool.num_pages, (
            f"pages: free {len(free)} + cached {len(cached)} + in use {len(private)} "
            f"!= total {self.pool.num_pages}"
        )
        assert len(set(everything)) == self.pool.num_pages, "a page is in two places"
        for seq in self.running:
            assert seq.status is Status.RUNNING and seq.row is not None
            assert len(seq.pages) * self.page_size >= seq.num_computed, (
                "computed tokens without pages"
            )
            if self.cache is not None and seq.node is not None:
                path, node = [], seq.node
                while node is not seq.tree.root:
                    path[:0] = node.pages
                    node = node.parent
                assert path == seq.pages[: seq.num_tree_pages], (
                    "tree pages differ from the locked path"
                )
        for seq in self.waiting:
            assert seq.status is Status.WAITING and not seq.pages and seq.row is None
        rows = self._free_rows + [r for s in self.running for r in [s.row, *s.extra_rows]]
        assert sorted(rows) == list(range(self.max_running_requests)), "slot-table rows leaked"
