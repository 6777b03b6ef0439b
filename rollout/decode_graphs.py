"""Decode steps at static shapes: the GPU fast path (CUDA graphs), and its CPU twin.

A pure decode step (every sequence computes its one pending token: no prefill, no drafts) of B
sequences runs at a bucket size P >= B over buffers whose shapes and addresses never change:
input ids, positions and K/V destination slots [P], a page table [P, N] covering `max_model_len`,
and an attention mask [P, 1, N * page_size] built from each row's length. Rows past B are padding:
they write their K/V into the pool's scratch page, which no sequence owns, and attend to that one
slot. Attention is the engine's own backend over a `DecodeMetadata` without shared prefixes (each
row reads its whole context): the one layout whose shapes do not depend on how sequences share
pages. The Triton backend skips the masked tail of each row; the torch backend reads all of it, so
this path pays off with Triton on a GPU.

On CUDA each bucket's forward (model + LM head) is captured once into a `torch.cuda.CUDAGraph` and
replayed, so a decode step is a few buffer copies and one graph launch instead of hundreds of
kernel launches from Python. Elsewhere the same static-shape function runs eagerly: that is how
tests compare it with the dynamic path on CPU.

Invariant: captured graphs hold the addresses of the parameters, the KV pool and these buffers.
Weight updates copy in place and keep them. When the parameters are released `reset()` drops
every bucket (`Engine.release_memory(weights=True)`); when only the pool was re-allocated,
`revalidate()` keeps the buckets and drops a captured graph only if the pool came back at other
addresses (the CPU path captures no address: it keeps everything). `captures` counts the buckets
built (buffers allocated; on CUDA, graph captured), so re-captures after a release are visible
(`Engine.stats()["graph_captures"]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.attention import AttentionMetadata, DecodeMetadata
from rollout.kv_pool import KVPool
from rollout.model import CausalLM
from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, then of 32 past 128: padding stays small where batches are
    small, and the number of graphs stays bounded."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 128 else 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


@dataclass
class _StaticBatch:
    """The fixed buffers of one bucket, and (on CUDA) its graph and output."""

    input_ids: torch.Tensor  # [P]
    positions: torch.Tensor  # [P]
    out_slots: torch.Tensor  # [P]
    page_table: torch.Tensor  # [P, N]
    lengths: torch.Tensor  # [P] tokens each row attends to (its new token included)
    bias: torch.Tensor  # [P, 1, N * page_size]: 0 below the row's length, -inf from there
    rows: torch.Tensor  # [P] arange: one query per row, in row order
    graph: object | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, attention, pool: KVPool, slot_table: torch.Tensor, max_batch: int
    ):
        if pool.scratch_page is None:
            raise ValueError(
                "static decode needs a KV pool with a scratch page (KVPool(scratch_page=True))"
            )
        self.model = model
        self.attention = attention
        self.pool = pool
        self.slot_table = slot_table
        self.page_size = pool.page_size
        self.device = slot_table.device
        self.buckets = bucket_sizes(max_batch)
        self.capture = self.device.type == "cuda"
        self._static: dict[int, _StaticBatch] = {}
        self._mempool = None
        self._captured_addresses: tuple[int, ...] | None = None  # of the graphs held
        self.replays = 0  # decode steps served by this path (captured or eager)
        self.captures = 0  # buckets built: buffers allocated, and on CUDA a graph captured

    def accepts(self, batch: ScheduledBatch) -> bool:
        return (
            not batch.prefill
            and 0 < len(batch.decode) <= self.buckets[-1]
            and not any(seq.draft for seq in batch.decode)
        )

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] of each sequence's pending token, as `ModelRunner.run` would return
        them."""
        size = next(b for b in self.buckets if b >= len(seqs))
        static = self._static.get(size) or self._allocate(size)
        self._fill(static, seqs)
        if self.capture:
            if static.graph is None:
                self._capture(static)
            static.graph.replay()
            logits = static.logits
        else:
            logits = self._forward(static)
        self.replays += 1
        return logits[: len(seqs)]

    def reset(self) -> None:
        """Forget every graph and buffer (the parameters are being released), and the attention
        backend's cached plan, built from these buffers."""
        self._static.clear()
        self._mempool = None
        self._captured_addresses = None
        self.attention.forget_plan()

    def revalidate(self) -> None:
        """After the pool or the parameters came back: keep the captured graphs if everything they
        read and write is where it was at capture, else drop the graphs (their buffers stay; each
        bucket is captured again at its next step)."""
        if self._captured_addresses is None or self._addresses() == self._captured_addresses:
            return
        for static in self._static.values():
            static.graph = static.logits = None
        self._mempool = None
        self._captured_addresses = None
        self.attention.forget_plan()

    def _addresses(self) -> tuple[int, ...]:
        """What a captured graph holds by address besides its own buffers: the pool's K/V and
        every parameter (0 for released storage)."""
        pool = self.pool
        kv = (pool.k.data_ptr(), pool.v.data_ptr()) if pool.allocated else (0, 0)
        return kv + tuple(p.data_ptr() for p in self.model.parameters())

    # -- buffers -------------------------------------------------------------------------------
    def _allocate(self, size: int) -> _StaticBatch:
        num_pages = self.slot_table.shape[1] // self.page_size + (
            self.slot_table.shape[1] % self.page_size > 0
        )
        kw = dict(dtype=torch.int64, device=self.device)
        static = _StaticBatch(
            input_ids=torch.zeros(size, **kw),
            positions=torch.zeros(size, **kw),
            out_slots=torch.zeros(size, **kw),
            page_table=torch.zeros(size, num_pages, **kw),
            lengths=torch.ones(size, **kw),
            bias=torch.zeros(
                size, 1, num_pages * self.page_size, dtype=torch.float32, device=self.device
            ),
            rows=torch.arange(size, **kw),
        )
        self._static[size] = static
        if not self.capture:  # on CUDA, counted at capture
            self.captures += 1
        return static

    def _fill(self, static: _StaticBatch, seqs: list[Sequence]) -> None:
        """Write this step's batch into the bucket's buffers, in place; rows past it are padding."""
        count, page = len(seqs), self.page_size
        rows = torch.tensor([s.row for s in seqs], dtype=torch.int64, device=self.device)
        computed = torch.tensor(
            [s.num_computed for s in seqs], dtype=torch.int64, device=self.device
        )
        pending = torch.tensor(
            [s.token_ids[s.num_computed] for s in seqs], dtype=torch.int64, device=self.device
        )
        scratch = self.pool.scratch_page
        static.input_ids.zero_()[:count] = pending
        static.positions.zero_()[:count] = computed
        static.out_slots.fill_(scratch * page)[:count] = self.slot_table[rows, computed]
        static.page_table.fill_(scratch)[:count] = self.slot_table[rows, ::page] // page
        static.lengths.fill_(1)[:count] = computed + 1
        width = static.bias.shape[-1]
        hidden = torch.arange(width, device=self.device) >= static.lengths.unsqueeze(-1)
        static.bias.zero_().masked_fill_(hidden.unsqueeze(1), float("-inf"))

    # -- the static forward --------------------------------------------------------------------
    def _forward(self, static: _StaticBatch) -> torch.Tensor:
        size = static.rows.shape[0]
        decode = DecodeMetadata(
            prefix_pages=static.page_table[:, :0],
            prefix_bias=static.bias[:, 0, :0],
            member_index=static.rows,
            group_size=1,
            suffix_pages=static.page_table,
            suffix_bias=static.bias,
            query_index=static.rows,
            token_cell=static.rows,
        )
        meta = AttentionMetadata(out_slots=static.out_slots, decode=decode, prefill=())
        assert meta.num_decode == size
        hidden = self.model(static.input_ids, static.positions, self.attention, meta)
        return self.model.compute_logits(hidden)

    def _capture(self, static: _StaticBatch) -> None:
        # Warm up on a side stream (Triton compiles, the allocator settles), then record. The
        # buffers hold padding-or-current rows; the warm-up's K/V writes go where this step's go.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            static.logits = self._forward(static)
        static.graph = graph
        self._captured_addresses = self._addresses()
        self.captures += 1
