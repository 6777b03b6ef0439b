"""Lookup proposers: drafts read from text already seen, no model.

* `ngram` (prompt lookup): the sequence's own prompt and completion;
* `group`: additionally the other samples of the same prompt and earlier completions of it, the
  redundancy GRPO creates (n samples of one prompt repeat each other, more so as the policy
  sharpens). All share one `SuffixIndex` per prompt.

Their drafts are point masses (`Draft.probs` is None).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING

from rollout.speculative.drafting import NO_DRAFT, Draft

if TYPE_CHECKING:
    from rollout.sequence import Sequence

PROPOSERS = ("ngram", "group")  # lookup proposers; "draft" lives in rollout.speculative.draft_model


class SuffixIndex:
    """n-gram -> where it last continued, over one or more growing token lists ("sources").

    For every position p of a source and every n in [min_n, max_n], key tuple(tokens[p-n:p])
    maps to (source, p): "after these n tokens came tokens[p:]". A lookup tries the longest n
    first and proposes what followed the latest occurrence."""

    def __init__(self, min_n: int, max_n: int, max_sources: int = 256):
        self.min_n, self.max_n = min_n, max_n
        self.max_sources = max_sources
        self._sources: OrderedDict[Hashable, list[int]] = OrderedDict()  # source id -> its tokens
        self._indexed: dict[Hashable, int] = {}  # source id -> positions indexed
        self._table: dict[tuple[int, ...], tuple[Hashable, int]] = {}

    def update(self, source_id: Hashable, tokens: list[int]) -> None:
        """Index the positions of `tokens` not yet seen (the list is kept by reference)."""
        if source_id not in self._sources:
            if len(self._sources) >= self.max_sources:  # forget the oldest source's entries lazily
                old, _ = self._sources.popitem(last=False)
                self._indexed.pop(old, None)
            self._sources[source_id] = tokens
            self._indexed[source_id] = 0
        start = self._indexed[source_id]
        # Position p is indexed once tokens[p] exists (so a hit always has a continuation).
        for p in range(max(start, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self._table[tuple(tokens[p - n : p])] = (source_id, p)
        self._indexed[source_id] = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._table.get(tuple(tokens[len(tokens) - n :]))
            if hit is None:
                continue
            source = self._sources.get(hit[0])
            if source is not None:
                return source[hit[1] : hit[1] + k]
        return []


class Proposer:
    """Keeps one SuffixIndex per sequence (`ngram`) or per prompt (`group`).

    A sequence is named by `seq.order`, (request_id, sample_index), unique over the engine's life
    and equal on two engines given the same requests; never by `id(seq)`, which CPython reuses
    for a new object once the old is freed, so a new sample would inherit a finished one's state
    depending on memory layout, and seeded runs would not repeat."""

    def __init__(self, method: str, min_n: int = 1, max_n: int = 4, max_indexes: int = 4096):
        if method not in PROPOSERS:
            raise ValueError(
                f"EngineConfig.speculative_method={method!r}: choose one of {PROPOSERS}"
            )
        self.method = method
        self.min_n, self.max_n = min_n, max_n
        self.max_indexes = max_indexes
        self._indexes: OrderedDict[object, SuffixIndex] = OrderedDict()

    def _index(self, seq: Sequence) -> SuffixIndex:
        key = tuple(seq.request.prompt) if self.method == "group" else seq.order
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = SuffixIndex(self.min_n, self.max_n)
            while len(self._indexes) > self.max_indexes:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(key)
        return index

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = self._index(seq)
        index.update(seq.order, seq.token_ids)
        return index.propose(seq.token_ids, k) if k > 0 else []

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [
            Draft(self.propose(seq, k), None) if k > 0 else NO_DRAFT for seq, k in zip(seqs, ks)
        ]

    def forget(self, seq: Sequence) -> None:
        """A sequence finished: `ngram` drops its index; `group` keeps it as an earlier
        completion."""
        if self.method == "ngram":
            self._indexes.pop(seq.order, None)
        else:
            self._index(seq).update(seq.order, seq.token_ids)
