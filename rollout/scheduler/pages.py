"""Pages of the KV pool for the scheduler's sequences: allocation (evicting unlocked cache leaves,
then dropping parked K/V, before the scheduler preempts anyone), the slot table and its rows, and
the radix prefix cache (with the trees retired by weight updates while sequences ran)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.kv_pool import KVPool, write_page_slots
from rollout.radix_cache import RadixCache
from rollout.routes import read_routes
from rollout.scheduler.parked import ParkedKV, ParkedKVStore
from rollout.scheduler.stats import SchedulerStats
from rollout.sequence import Sequence


class PageAllocator:
    """The pool's pages and the slot table's rows for the scheduler's sequences, and the prefix
    cache their pages go to. The slot table maps (row, position) -> KV slot for every admitted
    sequence: the model runner reads attention indices from it, so per-step metadata is a few
    tensor gathers."""

    def __init__(
        self,
        pool: KVPool,
        max_rows: int,
        max_model_len: int,
        enable_prefix_cache: bool,
        parked: ParkedKVStore,
        stats: SchedulerStats,
    ):
        self.pool = pool
        self.page_size = pool.page_size
        self.parked = parked
        self.stats = stats
        self.cache = RadixCache(self.page_size, pool.free_pages) if enable_prefix_cache else None
        # Trees retired by weight updates while sequences ran (`new_weights`), kept while a
        # running sequence or a parked entry still holds a path in them.
        self.retired_caches: list[RadixCache] = []
        self.slot_table = torch.zeros(
            (max_rows, max_model_len), dtype=torch.int64, device=pool.device
        )
        self.free_rows = list(range(max_rows - 1, -1, -1))

    # -- pages ---------------------------------------------------------------------------------
    def available_pages(self) -> int:
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        return self.pool.num_free_pages + evictable + self.parked.num_private_pages

    def alloc(self, count: int) -> list[int] | None:
        """`count` pages, evicting cache leaves and then dropping parked K/V (oldest first) as
        needed; None if even that leaves too few."""
        pages = self.pool.alloc_pages(count)
        while pages is None:
            if self.cache is not None:
                freed = self.cache.evict(count - self.pool.num_free_pages)
                self.stats.evicted_tokens += freed * self.page_size
                pages = self.pool.alloc_pages(count)
            if pages is not None or not self.parked.entries:
                break
            self.parked.drop(1)  # before any running sequence is preempted
            pages = self.pool.alloc_pages(count)
        return pages

    def pages_for(self, seq: Sequence, num_new: int) -> int:
        """New pages `seq` needs to hold K/V for `num_new` more tokens."""
        needed = -(-(seq.num_computed + num_new) // self.page_size)
        return max(0, needed - len(seq.pages))

    def write_pages(self, seq: Sequence, first_page: int = 0) -> None:
        """Slot-table entries of seq's pages from `first_page` on. A page's slots are written once,
        when the page joins the sequence, so most decode steps write nothing."""
        write_page_slots(self.slot_table, seq.row, seq.pages, first_page, self.page_size)

    def reserve(self, seq: Sequence, num_new: int, preempt_newest: Callable[[], Sequence]) -> bool:
        """Give `seq` pages for `num_new` more tokens, evicting and then having the scheduler
        preempt its newest running sequences as needed. False if `seq` itself was preempted."""
        count = self.pages_for(seq, num_new)
        if count == 0:  # most decode steps: the last page has room
            return True
        while (pages := self.alloc(count)) is None:
            if preempt_newest() is seq:
                return False
        seq.pages.extend(pages)
        self.write_pages(seq, len(seq.pages) - len(pages))
        return True

    def evict_for_step(self, count: int, rest: list[Sequence]) -> None:
        """Evict, in one pass over the tree, what `count` pages and the decodes of `rest` need
        beyond the free pages. Decoding sequences cross page boundaries together (forks of a
        prompt in lockstep); evicting for each in turn (`alloc`) walked the whole tree once per
        sequence."""
        if self.cache is None or not self.cache.evictable_pages:
            return
        need = count + sum(
            self.pages_for(s, 1 + len(s.draft))
            for s in rest
            if len(s.token_ids) - s.num_computed == 1
        )
        if need > self.pool.num_free_pages:
            freed = self.cache.evict(need - self.pool.num_free_pages)
            self.stats.evicted_tokens += freed * self.page_size

    def release(self, seq: Sequence, cache_kv: bool) -> None:
        """Return seq's pages, lock and rows. With `cache_kv`, its computed K/V is offered to the
        prefix cache first (only whole pages are kept). A mixture of experts' routes are read out
        first, while the page table is still the one its tokens were computed with."""
        self.keep_routes(seq)
        # K/V from before a weight update (a retired tree) is never offered to the new cache.
        if cache_kv and self.cache is not None and seq.tree is self.cache:
            self.insert_into_cache(seq)
        if seq.node is not None:
            seq.tree.unlock(seq.node)
        self.pool.free_pages(seq.private_pages)
        seq.pages, seq.num_tree_pages, seq.node, seq.tree = [], 0, None, None
        self.return_rows(seq)
        seq.new_kv_epoch()

    def keep_routes(self, seq: Sequence) -> None:
        """While `seq` holds its row: seq.routes <- the routes of its computed tokens, up to the
        last that was an input (`rollout.routes`). Without a row it keeps what it read last, or
        no routes at all if it never ran. Nothing for a dense model."""
        layout = self.pool.route_layout
        if layout is None:
            return
        if seq.row is not None:
            count = min(seq.num_computed, len(seq.token_ids) - 1)
            seq.routes = read_routes(self.pool.routes, self.slot_table, seq.row, count)
        elif seq.routes is None:
            seq.routes = layout.empty()

    def insert_into_cache(self, seq: Sequence) -> None:
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
            self.write_pages(seq)

    def share_completed_prompt(self, seq: Sequence) -> None:
        """`seq` computed its prompt: its whole pages go into the prefix cache, or, without one,
        into a tree of its own when forks will share them. That tree is retired from birth
        (`RadixCache.retire`): no other request ever matches it, and its pages go back to the
        pool when the last fork holding them lets go, as a retired cache's do."""
        if seq.tree is None:
            if seq.num_forks == 1:
                return
            seq.tree = RadixCache(self.page_size, self.pool.free_pages)
            seq.tree.retire()
        self.insert_into_cache(seq)

    def share_prompt(self, seq: Sequence, child: Sequence) -> bool:
        """Give fork `child` the K/V of `seq`'s completed prompt: the tree pages, locked once more,
        a copy of the partly filled last page (if any), and a row `seq` reserved for it. False
        if no page is free for the copy (the row is returned: `child` recomputes its tail)."""
        tail = seq.num_computed % self.page_size
        page = self.alloc(1) if tail else []
        if page is None:
            self.free_rows.append(seq.extra_rows.pop())
            return False
        child.pages = seq.pages[: seq.num_tree_pages] + page
        child.num_tree_pages, child.node, child.tree = seq.num_tree_pages, seq.node, seq.tree
        seq.tree.lock(seq.node)
        if tail:
            self.pool.copy_page_prefix(seq.pages[-1], page[0], tail)
        child.num_computed = seq.num_computed
        child.row = seq.extra_rows.pop()
        child.new_kv_epoch()
        self.write_pages(child)
        return True

    def take_prefix(self, seq: Sequence, budget: int, headroom: int) -> bool:
        """At admission: `seq` takes the parked K/V it continues, or else the longest cached
        prefix of its tokens (never the last, whose logits are needed), if the pages its first
        `budget` tokens need, plus `headroom`, are available; False (nothing taken) if not."""
        match = None
        # prompt log-probs still to compute need every prompt position's logits: no reuse
        full = seq.request.wants_prompt_logprobs
        parked = self.parked.find(seq) if not full else None
        if parked is not None:
            cached, have = parked.num_computed, len(parked.pages)
            available = self.available_pages() - len(parked.private_pages)
        else:
            if self.cache is not None:  # (the empty prefix when the prompt is computed in full)
                match = self.cache.match_prefix(seq.token_ids[: 0 if full else -1])
                # before counting: the matched pages are no longer evictable
                self.cache.lock(match.node)
            cached = match.num_tokens if match else 0
            have = len(match.pages) if match else 0
            available = self.available_pages()
        num_new = min(len(seq.token_ids) - cached, budget)
        need = -(-(cached + num_new) // self.page_size) - have
        if available < need + headroom:
            if match is not None:
                self.cache.unlock(match.node)
            return False
        if parked is not None:
            self.parked.adopt(seq, parked)
        elif match is not None:
            seq.node, seq.tree, seq.pages, seq.num_tree_pages = (
                match.node,
                self.cache,
                list(match.pages),
                len(match.pages),
            )
            seq.num_computed = cached
            self.stats.prefix_cache_hit_tokens += cached
        return True

    def new_weights(self, holders: list[Sequence | ParkedKV]) -> int:
        """No K/V cached under the old weights may serve a sequence admitted from now on. With
        nothing held, the cache is flushed; else the tree is retired (`RadixCache.retire`), kept
        while `holders` (running sequences, parked entries) hold a path in it, and a new one
        caches from now on. Returns the pages freed."""
        if self.cache is None:
            return 0
        if not holders and not self.cache.locked_pages:
            self.retired_caches = []  # nothing holds them: their pages are back in the pool
            return self.cache.reset()
        freed = self.cache.retire()
        self.retired_caches = [
            t for t in [*self.retired_caches, self.cache] if any(h.tree is t for h in holders)
        ]
        self.cache = RadixCache(self.page_size, self.pool.free_pages)
        return freed

    # -- slot-table rows -----------------------------------------------------------------------
    def take_rows(self, seq: Sequence) -> None:
        """A row for `seq` and one reserved for each fork to come (the caller checked there are
        enough: `free_rows`)."""
        seq.row = self.free_rows.pop()
        seq.extra_rows = [self.free_rows.pop() for _ in range(seq.num_forks - 1)]

    def return_rows(self, seq: Sequence) -> None:
        self.free_rows.append(seq.row)
        self.free_rows.extend(seq.extra_rows)
        seq.row, seq.extra_rows = None, []

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self, running: list[Sequence], parked: list[ParkedKV]) -> None:
        """free + cached + in use == total pages, each page in exactly one place; every tree path
        a sequence holds is its page table's head; rows likewise."""
        holders = [*running, *parked]
        free = self.pool.free_page_ids()
        direct_locks: dict[int, int] = {}
        for holder in holders:
            if holder.node is not None:
                direct_locks[id(holder.node)] = direct_locks.get(id(holder.node), 0) + 1
        trees = [self.cache, *self.retired_caches] if self.cache is not None else []
        for holder in holders:  # the trees a request's forks share without the cache
            if holder.tree is not None and not any(holder.tree is t for t in trees):
                assert holder.tree.retired, "unknown tree"
                trees.append(holder.tree)
        cached = [p for t in trees for p in t.check_integrity(direct_locks)]
        private = [p for s in holders for p in s.private_pages]
        everything = free + cached + private
        assert len(everything) == self.pool.num_pages, (
            f"pages: free {len(free)} + cached {len(cached)} + in use {len(private)} "
            f"!= total {self.pool.num_pages}"
        )
        assert len(set(everything)) == self.pool.num_pages, "a page is in two places"
        for seq in running:
            assert seq.row is not None
            assert len(seq.pages) * self.page_size >= seq.num_computed, (
                "computed tokens without pages"
            )
            if seq.node is not None:
                path, node = [], seq.node
                while node is not seq.tree.root:
                    path[:0] = node.pages
                    node = node.parent
                assert path == seq.pages[: seq.num_tree_pages], (
                    "tree pages differ from the locked path"
                )
        rows = self.free_rows + [r for s in running for r in [s.row, *s.extra_rows]]
        assert sorted(rows) == list(range(self.slot_table.shape[0])), "slot-table rows leaked"
