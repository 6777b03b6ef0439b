"""Persistent copies of decode sequences' private suffix K/V ("lanes"), for the torch backend.

Cascade decode attention reads each sequence's private suffix (its K/V after the shared group
prefix). Gathering it from the paged pool every step costs a full copy of every suffix, in every
layer, every step, although only one token per sequence changes. Instead each decode sequence
owns a *lane*: a contiguous row (in `accum_dtype`: float32, float64 for a float64 model; or
in a bfloat16 pool's own dtype, which the CPU decode kernel reads as stored)
`[layer, kv_head, lane, position - suffix_start, dim]` filled from the pool once, then kept in
sync by writing each step's new K/V to both the pool and the lane. Attention reads lanes
`[:num_seqs, :width]` in place (strided batched matmuls).

Invariant (checked by `check`, which `Engine.check_integrity` runs): for every assigned lane,
offsets `[0, seq.num_computed - start)` equal the pool's K/V at the sequence's slots for
positions `start + offset`, converted to the lanes' dtype (dequantized from an FP8 pool). It
holds because
* a lane is keyed by `Sequence.kv_epoch`, which changes whenever the page table changes other
  than by appending (admission, prefix-cache insert, fork, preemption, finish), and tree pages are
  immutable while private pages belong to one sequence;
* a lane is kept only while its sequence decodes in consecutive steps (the lanes of sequences
  absent from a step are freed), so no write to its pages can bypass the mirror;
* every decode-token K/V write to the pool is mirrored at the same position in the same
  forward pass (rejected speculative drafts included: both copies are overwritten later alike).
Entries past the valid offsets hold finite stale values (never NaN: buffers start as zeros and
are filled from the pool); attention gives them weight exactly 0.

Lanes `[0, num_seqs)` are exactly the step's decode sequences (compacted: a departing sequence's
lane is refilled by moving a higher one down), and the decode grid of `DecodeMetadata` lists the
sequences in lane order, so no copy reorders them.

The shared prefixes are kept too (`prefix`): cascade attention reads each decode group's prefix
K/V (its radix pages, gathered from the pool into [Hkv, G, Lp, dim]); the gathered tensors of the
last step are reused while the step's groups are the same. Key: each group's leading sequence's
`(kv_epoch, num_tree_pages)` in grid order. A leader whose epoch is unchanged has held its lock on
those tree pages since the copy was made, and locked tree pages are immutable, so the copy still
equals the pool over each group's prefix; any other change of the groups changes the key and
re-gathers. (Past a shorter group's prefix the padding columns hold finite stale values, which
the prefix bias gives weight exactly 0, as with the gather.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.config import accum_dtype
from rollout.kv_pool import KVPool, index_select, store_kv_rows

if TYPE_CHECKING:
    from rollout.sequence import Sequence


@dataclass
class _Lane:
    epoch: int  # the sequence's kv_epoch when the lane was filled
    start: int  # first position of the suffix (page aligned)


@dataclass(frozen=True)
class LanePlan:
    order: list[int]  # order[lane] = index in the step's decode list of the sequence in it
    lane_of: list[int]  # lane_of[i] = lane of decode sequence i
    write_index: (
        torch.Tensor
    )  # [num decode tokens, batch order] flat (lane * capacity + offset) to mirror into
    width: int  # suffix width attention reads (whole pages, as the gather path)
    computed: list[int]  # computed[i]: suffix tokens of decode sequence i already in its lane
    epochs: list[int]  # epochs[i]: kv_epoch of decode sequence i
    in_order: bool  # order == lane_of == range(len): lane i holds decode sequence i


class SuffixLanes:
    def __init__(self, pool: KVPool, max_tokens: int, dtype: torch.dtype | None = None):
        self.pool = pool
        # accum_dtype by default; the pool's own bfloat16 where the decode kernel reads it
        self.dtype = dtype or accum_dtype(pool.dtype)
        self.max_tokens = max_tokens  # lanes x capacity bound (memory), else the gather path
        self.k: torch.Tensor | None = None  # [layers, Hkv, lanes, capacity, dim]
        self.v: torch.Tensor | None = None
        self.lanes: list[_Lane | None] = []
        self.lane_of_epoch: dict[int, int] = {}
        self._prefix_key: tuple | None = None  # DecodeMetadata.prefix_key of the copies below
        self._prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (K, V)
        self._prefix_pages: torch.Tensor | None = None  # [G, Np] the copies were gathered from
        # The last plan's sequences (their kv_epochs, in decode order) and their lanes.
        self._last_epochs: list[int] | None = None
        self._last_lane_of: list[int] = []
        self._last_order: list[int] = []
        self._last_in_order = False

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    def release(self) -> None:
        """Drop the buffers and every lane (the pool is being freed)."""
        self.k = self.v = None
        self.lanes, self.lane_of_epoch = [], {}
        self._prefix_key, self._prefix, self._prefix_pages = None, {}, None
        self._last_epochs = None

    def forget(self) -> None:
        """Free every lane (keeping the buffers): a step without decode breaks continuity."""
        self.lanes, self.lane_of_epoch = [None] * len(self.lanes), {}
        self._prefix_key, self._prefix = None, {}
        self._last_epochs = None

    def prefix(
        self, layer: int, key: tuple, pages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' prefix K, V of `layer` ([Hkv, G, Lp, dim], the lanes' dtype) for the prefix
        `pages` [G, Np]: last step's copy when `key` (DecodeMetadata.prefix_key) is unchanged,
        else gathered from the pool now and kept."""
        if key != self._prefix_key:
            self._prefix_key, self._prefix, self._prefix_pages = key, {}, pages
        kv = self._prefix.get(layer)
        if kv is None:
            kv = self._prefix[layer] = (
                self._gather_pages(self.pool.k[layer], pages, "k", layer),
                self._gather_pages(self.pool.v[layer], pages, "v", layer),
            )
        return kv

    def _gather_pages(
        self, cache: torch.Tensor, pages: torch.Tensor, which: str, layer: int
    ) -> torch.Tensor:
        """cache [Hkv, slots, dim] (the pool's `which` of `layer`), pages [G, Np] ->
        [Hkv, G, Np * page_size, dim], the lanes' dtype (dequantized from an FP8 pool)."""
        heads, _, dim = cache.shape
        page = self.pool.page_size
        gathered = index_select(cache.view(heads, -1, page * dim), 1, pages.reshape(-1))
        gathered = gathered.view(heads, pages.shape[0], pages.shape[1] * page, dim)
        return self._as_lane(gathered, which, layer)

    def _as_lane(self, stored: torch.Tensor, which: str, layer: int | None = None):
        """Rows read from the pool (`KVPool.dequantized`'s arguments) in the lanes' dtype."""
        if not self.pool.quantized and stored.dtype == self.dtype:
            return stored
        return self.pool.dequantized(stored, which, layer).to(self.dtype)

    def _ensure(self, num_lanes: int, width: int) -> bool:
        """Room for `num_lanes` lanes of `width` positions, growing geometrically (contents
        kept)."""
        lanes, capacity = len(self.lanes), self.capacity
        if num_lanes <= lanes and width <= capacity and self.k is not None:
            return True
        page = self.pool.page_size
        new_lanes = max(num_lanes, lanes)
        if new_lanes * width > self.max_tokens:
            return False
        new_capacity = (
            max(width, capacity)
            if width <= capacity
            else -(-max(width, 2 * capacity) // page) * page
        )
        # Doubling is capped by the bound (whole pages, at least `width`): a doubling that
        # does not fit must not send every later step to the gather path. More lanes at the
        # bound may shrink the capacity, never below `width`: a lane this step keeps holds
        # fewer valid offsets than `width`, so copying the first `new_capacity` keeps them all.
        new_capacity = max(width, min(new_capacity, self.max_tokens // new_lanes // page * page))
        keep = min(capacity, new_capacity)
        pool = self.pool
        shape = (pool.num_layers, pool.num_kv_heads, new_lanes, new_capacity, pool.head_dim)
        # zeros: stale entries must be finite (weight 0 times NaN would be NaN)
        k = torch.zeros(shape, dtype=self.dtype, device=pool.device)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[:, :, :lanes, :keep] = self.k[:, :, :, :keep]
            v[:, :, :lanes, :keep] = self.v[:, :, :, :keep]
        self.k, self.v = k, v
        self.lanes = self.lanes + [None] * (new_lanes - lanes)
        return True

    def plan(self, seqs: list[Sequence], drafting: bool = True) -> LanePlan | None:
        """Assign lanes [0, len(seqs)) to this step's decode sequences: keep valid lanes, move high
        ones down, fill new ones from the pool. None: lanes would exceed the memory bound; the
        caller gathers from the pool this step (and every lane is dropped: it will miss a write).
        `drafting` False promises that no sequence holds a draft (one query each)."""
        page = self.pool.page_size
        num = len(seqs)
        starts = [s.num_tree_pages * page for s in seqs]
        computed = [s.num_computed - st for s, st in zip(seqs, starts)]
        if drafting:
            end = max(c + 1 + len(s.draft) for s, c in zip(seqs, computed))
        else:
            end = max(computed) + 1
        width = -(-end // page) * page
        if not self._ensure(num, width):
            self.forget()
            return None

        epochs = [s.kv_epoch for s in seqs]
        if epochs == self._last_epochs:
            # The same sequences in the same order as the last plan: the assignment below would
            # keep every lane where it is (lanes [0, num) hold exactly them; nothing to move or
            # fill). Consecutive decode steps of a steady batch take this path.
            lane_of, order, in_order = self._last_lane_of, self._last_order, self._last_in_order
        else:
            lane_of = self._assign(seqs, starts, computed)
            order = [0] * num
            for i, lane in enumerate(lane_of):
                order[lane] = i
            in_order = order == list(range(num))
            self._last_epochs, self._last_lane_of, self._last_order = epochs, lane_of, order
            self._last_in_order = in_order
        capacity = self.capacity
        if drafting and any(s.draft for s in seqs):
            write = [
                lane * capacity + c + j
                for lane, c, s in zip(lane_of, computed, seqs)
                for j in range(1 + len(s.draft))
            ]
        else:  # one token each
            write = [lane * capacity + c for lane, c in zip(lane_of, computed)]
        write_index = torch.tensor(write, dtype=torch.int64, device=self.pool.device)
        return LanePlan(order, lane_of, write_index, width, computed, epochs, in_order)

    def _assign(self, seqs: list[Sequence], starts: list[int], computed: list[int]) -> list[int]:
        """Lanes of this step's decode sequences (see `plan`): kept, moved down, or filled."""
        num = len(seqs)
        # Keep the lanes of sequences still decoding in the same epoch; free the others.
        kept: dict[int, int] = {}  # decode index -> lane
        for i, s in enumerate(seqs):
            lane = self.lane_of_epoch.get(s.kv_epoch)
            if lane is not None:
                kept[i] = lane
        kept_lanes = set(kept.values())
        for lane, record in enumerate(self.lanes):
            if record is not None and lane not in kept_lanes:
                self.lanes[lane] = None
        free_low = [lane for lane in range(num - 1, -1, -1) if self.lanes[lane] is None]
        moves: list[tuple[int, int]] = []
        for i, lane in kept.items():
            if lane >= num:  # compact: lanes [0, num) hold exactly this step's sequences
                dst = free_low.pop()
                moves.append((lane, dst))
                self.lanes[dst], self.lanes[lane] = self.lanes[lane], None
                kept[i] = dst
        fills: list[tuple[int, int]] = []  # (decode index, lane)
        for i in range(num):
            if i not in kept:
                lane = free_low.pop()
                self.lanes[lane] = _Lane(seqs[i].kv_epoch, starts[i])
                kept[i] = lane
                fills.append((i, lane))
        assert not free_low
        self.lane_of_epoch = {seqs[i].kv_epoch: lane for i, lane in kept.items()}

        if moves:
            src = torch.tensor([m[0] for m in moves], device=self.pool.device)
            dst = torch.tensor([m[1] for m in moves], device=self.pool.device)
            for buf in (self.k, self.v):
                buf.index_copy_(2, dst, buf.index_select(2, src))
        if fills:
            self._fill(
                [seqs[i] for i, _ in fills],
                [computed[i] for i, _ in fills],
                [lane for _, lane in fills],
            )

        return [kept[i] for i in range(num)]

    def _fill(self, seqs: list[Sequence], computed: list[int], lanes: list[int]) -> None:
        """Copy the computed suffix of each sequence (whole pages) from the pool into its lane."""
        page, pool = self.pool.page_size, self.pool
        num_pages = max(-(-c // page) for c in computed)
        if num_pages == 0:
            return
        # Pad with page 0: finite values past the valid offsets, overwritten or masked later.
        pages = [
            s.pages[s.num_tree_pages : s.num_tree_pages + -(-c // page)]
            for s, c in zip(seqs, computed)
        ]
        pages = torch.tensor(
            [p + [0] * (num_pages - len(p)) for p in pages], device=pool.device
        ).view(-1)
        index = torch.tensor(lanes, device=pool.device)
        width = num_pages * page * pool.head_dim
        for which, src, dst in (("k", pool.k, self.k), ("v", pool.v, self.v)):
            paged = src.view(
                pool.num_layers, pool.num_kv_heads, pool.num_pages, page * pool.head_dim
            )
            gathered = index_select(paged, 2, pages).view(
                pool.num_layers, pool.num_kv_heads, len(seqs), width
            )
            flat = dst.view(*dst.shape[:3], -1)
            flat[..., :width].index_copy_(2, index, self._as_lane(gathered, which))

    def views(self, layer: int, num_seqs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Suffix K, V of lanes [0, num_seqs), `width` positions: [Hkv, num_seqs, width, dim]
        views."""
        return self.k[layer, :, :num_seqs, :width], self.v[layer, :, :num_seqs, :width]

    def mirror(
        self, layer: int, write_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write this step's decode-token K/V ([T, Hkv, dim], pool dtype) into their lanes."""
        dst_k, dst_v = (buf[layer].view(buf.shape[1], -1, buf.shape[4]) for buf in (self.k, self.v))
        store_kv_rows(dst_k, dst_v, write_index, k, v)

    def check(self, running: list[Sequence]) -> None:
        """Assert the invariant of the module docstring for every lane still assigned."""
        by_epoch = {s.kv_epoch: s for s in running}
        # Prefix copies whose leaders all still run (the key could match again) equal the pool
        # over each group's prefix (the padding past it is masked out of attention).
        leaders = self._prefix_key or ()
        if all(e in by_epoch and by_epoch[e].num_tree_pages == n for e, n in leaders):
            for layer, (k, v) in self._prefix.items():
                for which, copy in (("k", k), ("v", v)):
                    cache = getattr(self.pool, which)[layer]
                    fresh = self._gather_pages(cache, self._prefix_pages, which, layer)
                    for g, (_, pages) in enumerate(leaders):
                        width = pages * self.pool.page_size
                        assert torch.equal(copy[:, g, :width], fresh[:, g, :width]), (
                            "group prefix copy differs from the KV pool"
                        )
        page, pool = self.pool.page_size, self.pool
        for epoch, lane in self.lane_of_epoch.items():
            record = self.lanes[lane]
            assert record is not None and record.epoch == epoch, "lane bookkeeping out of sync"
            seq = by_epoch.get(epoch)
            if seq is None:  # left since the last step: freed at the next plan, never read
                continue
            assert record.start == seq.num_tree_pages * page, (
                "lane suffix start moved without a new epoch"
            )
            count = seq.num_computed - record.start
            pages = torch.tensor(seq.pages[seq.num_tree_pages :], dtype=torch.int64)
            slots = (pages[:, None] * page + torch.arange(page)).flatten()[:count].to(pool.device)
            for which, src, dst in (("k", pool.k, self.k), ("v", pool.v, self.v)):
                expected = self._as_lane(index_select(src, 2, slots), which)
                assert torch.equal(dst[:, :, lane, :count], expected), (
                    "lane differs from the KV pool"
                )
