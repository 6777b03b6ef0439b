"""Parked K/V (`SamplingParams.park_kv`, over-sampling's `partial: in_place`).

A sample aborted mid-generation keeps its pages (and its lock on the tree path) here instead of
freeing them; a later `park_kv` request whose prompt is exactly that sample's tokens adopts them
and computes only what was pending. Parked K/V outlives weight updates (its tree is retired, never
matched by others): that is what `in_place` keeps. It is dropped, oldest first, before any
running sequence is preempted, and when the engine flushes its cache or releases memory; the
continuation then prefills (as `retract` does).
"""

from __future__ import annotations

from typing import NamedTuple

from rollout.kv_pool import KVPool
from rollout.radix_cache import RadixCache, TreeNode
from rollout.scheduler.stats import SchedulerStats
from rollout.sequence import Sequence


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


class ParkedKVStore:
    """The parked entries, oldest first."""

    def __init__(self, pool: KVPool, stats: SchedulerStats):
        self.pool = pool
        self.stats = stats
        self.entries: list[ParkedKV] = []

    def park(self, seq: Sequence) -> None:
        """Keep `seq`'s pages and tree lock; `seq` holds none afterwards (its slot-table rows are
        the caller's to return)."""
        self.entries.append(
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
        seq.new_kv_epoch()

    def find(self, seq: Sequence) -> ParkedKV | None:
        """The entry a `park_kv` sequence about to be admitted continues, if any."""
        if not self.entries or not seq.request.params.park_kv or seq.num_forks != 1:
            return None
        tokens = tuple(seq.token_ids)
        return next((p for p in self.entries if p.tokens == tokens), None)

    def adopt(self, seq: Sequence, parked: ParkedKV) -> None:
        """`seq` takes `parked`'s pages, tree lock and computed tokens."""
        self.entries.remove(parked)
        seq.node, seq.tree = parked.node, parked.tree
        seq.pages, seq.num_tree_pages = list(parked.pages), parked.num_tree_pages
        seq.num_computed = parked.num_computed
        self.stats.parked_reused_tokens += parked.num_computed

    def drop(self, count: int | None = None) -> int:
        """Free the oldest `count` entries (all by default); returns the pages freed."""
        drop = self.entries[:count] if count is not None else list(self.entries)
        del self.entries[: len(drop)]
        freed = 0
        for p in drop:
            if p.node is not None:
                p.tree.unlock(p.node)
            self.pool.free_pages(p.private_pages)
            freed += len(p.private_pages)
            self.stats.parked_dropped_tokens += p.num_computed
        return freed

    @property
    def num_private_pages(self) -> int:
        """Pages only parked entries hold (their tree pages may be shared)."""
        return sum(len(p.private_pages) for p in self.entries)

    def check_integrity(self) -> None:
        """Every entry holds pages for its computed tokens and has its last token pending."""
        for p in self.entries:
            assert len(p.pages) * self.pool.page_size >= p.num_computed, "parked K/V without pages"
            assert p.num_computed < len(p.tokens), "a parked entry has no pending token"
