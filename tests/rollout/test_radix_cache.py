"""Radix prefix cache: matching, insertion, splitting, locking and LRU eviction, with the
expected pages worked out by hand for each case."""

import pytest

from rollout.radix_cache import RadixCache


class PageLedger:
    """Stands in for the KV pool's free list: records the pages the cache hands back."""

    def __init__(self):
        self.freed: list[int] = []

    def __call__(self, pages):
        self.freed.extend(pages)


def make(page_size=1):
    ledger = PageLedger()
    return RadixCache(page_size, ledger), ledger


def test_match_on_empty_tree_is_empty():
    cache, _ = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.node is cache.root and m.pages == [] and m.num_tokens == 0


def test_insert_then_match_longest_prefix_and_split():
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.pages == [10, 11, 12, 13] and m.num_tokens == 4
    # A diverging prefix splits the edge after the common part.
    m = cache.match_prefix([1, 2, 9])
    assert m.pages == [10, 11] and m.num_tokens == 2
    assert cache.insert([1, 2, 9], [10, 11, 20]) == 2  # first two already cached
    assert cache.match_prefix([1, 2, 9, 9]).pages == [10, 11, 20]
    assert sorted(cache.check_integrity()) == [10, 11, 12, 13, 20]


def test_pages_are_matched_whole():
    cache, _ = make(page_size=4)
    cache.insert(list(range(8)), [5, 6])
    assert cache.match_prefix(list(range(7))).pages == [5]  # 7 tokens: one whole page
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).pages == [5]  # mismatch inside page 2
    assert cache.match_prefix(list(range(8)) + [1]).pages == [5, 6]
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], [7])  # not whole pages


def test_locked_prefix_survives_eviction_and_lru_order():
    cache, ledger = make()
    cache.insert([1, 2, 3], [1, 2, 3])  # older
    cache.insert([7, 8], [7, 8])  # newer
    cache.match_prefix([1, 2, 3])  # touch: [1,2,3] is now the most recent
    assert cache.evict(1) == 2 and ledger.freed == [7, 8]  # whole LRU leaf
    node = cache.match_prefix([1, 2, 3]).node
    cache.lock(node)
    assert cache.evictable_pages == 0 and cache.locked_pages == 3
    assert cache.evict(10) == 0
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(node)
    assert cache.evictable_pages == 3
    assert cache.evict(10) == 3 and sorted(ledger.freed) == [1, 2, 3, 7, 8]
    assert cache.cached_pages == 0 and cache.check_integrity() == []


def test_lock_protects_ancestors_after_split():
    cache, _ = make()
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    leaf = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(leaf)
    cache.insert([1, 2, 5], [1, 2, 5])  # splits the locked edge at 2
    cache.check_integrity(direct_locks={id(leaf): 1})
    assert cache.evictable_pages == 1  # only the new [5] leaf
    assert cache.evict(5) == 1
    cache.unlock(leaf)
    assert cache.evictable_pages == 4


def test_evicting_a_leaf_exposes_its_parent():
    cache, ledger = make()
    cache.insert([1, 2], [1, 2])
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([1, 2, 4], [1, 2, 4])
    assert cache.evict(3) == 4  # both leaves, then the now-childless parent
    assert sorted(ledger.freed) == [1, 2, 3, 4]


def test_reset_frees_everything_once():
    cache, ledger = make(page_size=2)
    cache.insert([1, 2, 3, 4], [8, 9])
    cache.insert([1, 2, 5, 6], [8, 7])
    assert cache.reset() == 3 and sorted(ledger.freed) == [7, 8, 9]
    assert cache.match_prefix([1, 2]).num_tokens == 0


def _common_whole_pages(a: list[int], b: list[int], page: int) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % page


def _random_tree(seed: int, page: int, inserts: int):
    """A tree grown from random sequences over 3 token ids (so edges diverge mid-page and at page
    ends, and are split often), most extending an earlier one; after each insert, a probe that
    follows an inserted sequence for a while and then diverges. Yields (cache, inserted, probe)."""
    import random

    rng = random.Random(seed)
    cache, _ = make(page)
    inserted: list[list[int]] = []
    pages = iter(range(10**6))
    for _ in range(inserts):
        base = rng.choice(inserted) if inserted and rng.random() < 0.8 else []
        seq = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(12)]
        seq = seq[: len(seq) - len(seq) % page]
        cache.insert(seq, [next(pages) for _ in range(len(seq) // page)])
        inserted.append(seq)
        yield cache, inserted, rng.choice(inserted)[: rng.randrange(1, 30)] + [rng.randrange(3)] * 3
    cache.check_integrity()


def test_matches_the_longest_whole_page_prefix_of_any_inserted_sequence():
    """A match is the longest whole-page common prefix with any inserted sequence, the
    brute-force answer, on random trees."""
    for page in (1, 4):
        for cache, inserted, probe in _random_tree(0, page, 150):
            want = max(_common_whole_pages(probe, s, page) for s in inserted)
            assert cache.match_prefix(probe).num_tokens == want


def _shape(cache: RadixCache) -> list[tuple]:
    """Every node's edge, pages, access time and locks, in a canonical order."""
    return sorted((tuple(n.key), tuple(n.pages), n.last_access, n.lock_ref) for n in cache._nodes())


def test_cached_prefix_length_is_the_match_and_changes_nothing():
    """`cached_prefix_length` answers what `match_prefix` would (the brute-force longest
    whole-page common prefix, too) on random trees, probes diverging mid-edge included, and
    leaves the tree as it was: no split, no access time (so eviction order), no lock."""
    for page in (1, 4):
        for cache, inserted, probe in _random_tree(1, page, 100):
            before = _shape(cache)
            got = cache.cached_prefix_length(probe)
            assert _shape(cache) == before
            assert got == max(_common_whole_pages(probe, s, page) for s in inserted)
            assert got == cache.match_prefix(probe).num_tokens


def test_cached_prefix_length_does_not_reorder_eviction():
    asked, ledger_asked = make()
    quiet, ledger_quiet = make()
    for cache in (asked, quiet):
        cache.insert([1, 2, 3], [1, 2, 3])  # older
        cache.insert([7, 8], [7, 8])  # newer
    assert asked.cached_prefix_length([1, 2, 3, 4]) == 3  # a match would make [1,2,3] newest
    assert asked.cached_prefix_length([1, 9]) == 1  # a match would split [1,2,3]
    assert asked.evict(1) == quiet.evict(1) == 3
    assert ledger_asked.freed == ledger_quiet.freed == [1, 2, 3]
    retired, _ = make()
    retired.insert([1, 2], [1, 2])
    retired.retire()
    assert retired.cached_prefix_length([1, 2, 3]) == 0  # never matched again
