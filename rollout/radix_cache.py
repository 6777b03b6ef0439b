"""Radix tree from token ids to KV pages: the prefix cache.

Every edge holds a run of tokens whose length is a multiple of `page_size` and the pages that
hold their K/V. Invariants (checked by `check_integrity`):

* pages in the tree are full and immutable: requests only ever append to private pages;
* a node's `lock_ref` = requests locking it directly + the sum of its children's `lock_ref`
  (locking a node locks the whole path to the root, so a prefix in use is never evicted);
* `evictable_pages` / `locked_pages` count the pages of nodes with lock_ref == 0 / > 0;
* the root holds no tokens and is never evicted.

A weight update while requests run (`Engine.update_weights(keep_running=True)`) *retires* the
tree (`retire`): its unlocked nodes are freed at once, and it is never matched again, so no
request admitted after the update is served K/V computed by the old weights. The running
sequences keep their locked paths (their K/V is what `in_place` keeps); a retired node's pages
are freed the moment its last lock goes, since nothing can reach them any more.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import NamedTuple


class TreeNode:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(
        self,
        parent: TreeNode | None = None,
        key: list[int] | None = None,
        pages: list[int] | None = None,
    ):
        self.children: dict = {}
        self.parent = parent
        self.key: list[int] = key or []
        self.pages: list[int] = pages or []
        self.lock_ref = 0
        self.last_access = 0


class MatchResult(NamedTuple):
    node: TreeNode  # deepest node of the match (lock it while the pages are used)
    pages: list[int]  # pages of the matched prefix, root to node
    num_tokens: int  # len(pages) * page_size


class RadixCache:
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]):
        self.page_size = page_size
        self._free_pages = free_pages
        self._clock = itertools.count(1)
        self.root = TreeNode()
        self.evictable_pages = 0
        self.locked_pages = 0
        self.retired = False

    # -- lookup and insertion -----------------------------------------------------------------
    def _child_key(self, tokens: list[int], start: int):
        return (
            tokens[start] if self.page_size == 1 else tuple(tokens[start : start + self.page_size])
        )

    def _common_pages_len(self, key: list[int], tokens: list[int], start: int, end: int) -> int:
        """Length (in tokens, page aligned) of the common prefix of `key` and tokens[start:end]."""
        page = self.page_size
        limit = min(len(key), end - start)
        limit -= limit % page
        if key[:limit] == tokens[start : start + limit]:  # the common case: one C comparison
            return limit
        i = 0  # else whole pages, each compared as a slice
        while i < limit and key[i : i + page] == tokens[start + i : start + i + page]:
            i += page
        return i

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node`'s edge after `at` tokens; returns the new upper node."""
        upper = TreeNode(node.parent, node.key[:at], node.pages[: at // self.page_size])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.key = node.key[at:]
        node.pages = node.pages[at // self.page_size :]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """Longest cached prefix of `tokens`, in whole pages. Callers that need the logits of the
        last token pass `tokens[:-1]` so it is never matched. A retired tree is matched only by
        the sequences already holding it (their forks share the prompt they inserted)."""
        end = len(tokens) - len(tokens) % self.page_size
        now = next(self._clock)
        node, pages, i = self.root, [], 0
        while i < end:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            common = self._common_pages_len(child.key, tokens, i, end)
            if common < len(child.key):
                child = self._split(child, common)
            pages.extend(child.pages)
            i += common
            node = child
            node.last_access = now
        return MatchResult(node, pages, i)

    def cached_prefix_length(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` `match_prefix` would match now (whole pages),
        read without touching the tree: no split, no access time, no lock, so asking changes
        neither what is evicted next nor what the next request matches."""
        if self.retired:
            return 0
        end = len(tokens) - len(tokens) % self.page_size
        node, i = self.root, 0
        while i < end:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            common = self._common_pages_len(child.key, tokens, i, end)
            i += common
            if common < len(child.key):
                break
            node = child
        return i

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Cache `pages` as the K/V of `tokens` (len(tokens) == len(pages) * page_size).

        Returns how many leading tokens were already cached: for those the tree keeps its own
        pages, and the caller frees any of its pages there that are not the tree's.
        """
        assert len(tokens) == len(pages) * self.page_size, "insert takes whole pages"
        now = next(self._clock)
        node, i, end = self.root, 0, len(tokens)
        while i < end:
            child_key = self._child_key(tokens, i)
            child = node.children.get(child_key)
            if child is None:
                leaf = TreeNode(node, tokens[i:end], pages[i // self.page_size :])
                leaf.last_access = now
                node.children[child_key] = leaf
                self.evictable_pages += len(leaf.pages)
                return i
            common = self._common_pages_len(child.key, tokens, i, end)
            if common < len(child.key):
                child = self._split(child, common)
            i += common
            node = child
            node.last_access = now
        return i

    # -- locking ------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_pages -= len(node.pages)
                if self.retired:  # its children are gone already (lock_ref >= theirs)
                    del node.parent.children[self._child_key(node.key, 0)]
                    self._free_pages(node.pages)
                else:
                    self.evictable_pages += len(node.pages)
            node = node.parent

    # -- eviction -----------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, least recently used first (or
        as many as are evictable). Returns the number of pages freed."""
        order = itertools.count()  # tie-break so heap entries never compare nodes
        heap = [
            (n.last_access, next(order), n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            self._free_pages(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def reset(self) -> int:
        """Drop every cached page (nothing may be locked). Returns the number of pages freed."""
        if self.locked_pages:
            raise RuntimeError("cannot flush the prefix cache while requests are using it")
        pages = [p for n in self._nodes() for p in n.pages]
        self._free_pages(pages)
        self.root = TreeNode()
        self.evictable_pages = 0
        return len(pages)

    def retire(self) -> int:
        """Free every unlocked page and stop serving matches (see the module doc); the locked
        paths stay until their holders unlock them. Returns the number of pages freed."""
        freed = self.evict(self.evictable_pages)
        self.retired = True
        return freed

    # -- introspection ------------------------------------------------------------------------
    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root (iterative: deep trees must not hit the recursion limit)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.locked_pages

    def check_integrity(self, direct_locks: dict[int, int] | None = None) -> list[int]:
        """Verify the invariants in the module docstring; returns every page in the tree.

        `direct_locks` maps id(node) -> number of requests holding that node; when given, each
        lock_ref must equal those plus the children's lock_refs exactly.
        """
        pages: list[int] = []
        evictable = locked = 0
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.pages) * self.page_size, (
                "edge is not whole pages"
            )
            assert node.parent.children.get(self._child_key(node.key, 0)) is node, (
                "child under the wrong key"
            )
            assert node.lock_ref >= 0, "negative lock_ref"
            below = sum(c.lock_ref for c in node.children.values())
            if direct_locks is not None:
                assert node.lock_ref == below + direct_locks.get(id(node), 0), (
                    "lock_ref != locks below + own"
                )
            else:
                assert node.lock_ref >= below, "lock_ref smaller than its children's"
            if node.lock_ref:
                locked += len(node.pages)
            else:
                evictable += len(node.pages)
            pages.extend(node.pages)
        assert (evictable, locked) == (self.evictable_pages, self.locked_pages), (
            "page counters drifted"
        )
        assert len(set(pages)) == len(pages), "a page is cached twice"
        return pages
