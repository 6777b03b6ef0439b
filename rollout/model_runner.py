"""Turns a scheduled batch into tensors, runs the model, and returns the logits to sample from."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollout.attention import AttentionMetadata, DecodeMetadata, PrefillSegment, TorchAttention
from rollout.logprobs import prompt_rows
from rollout.model import CausalLM
from rollout.routes import record_routes
from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence
from rollout.suffix_lanes import SuffixLanes


class StepPlan(NamedTuple):
    """Everything one forward needs; a tensor-parallel rank 0 sends it to the other ranks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # KV slots written and read
    logits_rows: torch.Tensor  # [R] rows of the batch whose logits are sampled


def execute(model: CausalLM, attention: TorchAttention, plan: StepPlan) -> torch.Tensor:
    """The forward of one step: float32 logits (float64 for a float64 model), one row per
    `plan.logits_rows`. A mixture of experts' routes go to the pool beside the K/V."""
    hidden = model(plan.input_ids, plan.positions, attention, plan.meta)
    record_routes(model.routes(), attention.pool.routes, plan.meta.out_slots)
    # Distinct increasing rows: as many as the batch's tokens means every row (a decode step).
    if plan.logits_rows.shape[0] != hidden.shape[0]:
        hidden = hidden[plan.logits_rows]
    return model.compute_logits(hidden)


class _Layout(NamedTuple):
    """The part of a step's `DecodeMetadata` that stays the same while the same sequences decode
    one query each (see `ModelRunner._decode_metadata`)."""

    prefix_pages: torch.Tensor
    prefix_bias: torch.Tensor
    member_index: torch.Tensor
    group_size: int
    query_index: torch.Tensor
    token_cell: torch.Tensor
    prefix_key: tuple | None  # each group leader's (kv_epoch, num_tree_pages), in group order
    members_in_order: bool
    grid_is_batch: bool


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attention: TorchAttention,
        slot_table: torch.Tensor,
        page_size: int,
    ):
        self.model = model
        self.page_size = page_size
        self.attention = attention
        self.slot_table = slot_table  # owned by the scheduler: (row, position) -> KV slot
        self.device = slot_table.device
        self._steady: tuple[tuple, _Layout] | None = None  # the last one-query step's layout

    def forget_plan(self) -> None:
        """Drop what is kept from the last steps (the steady decode layout, the attention's
        decode plan): their tensors must not outlive a release of the memory they describe."""
        self._steady = None
        self.attention.forget_plan()

    @property
    def suffix_lanes(self) -> SuffixLanes | None:
        """The attention's lanes, when it reads decode suffixes from them (then the metadata
        names no suffix pages). Read from the attention, so swapping it swaps them too."""
        return getattr(self.attention, "suffix_lanes", None)

    def prepare(self, batch: ScheduledBatch) -> StepPlan:
        """(input_ids [T], positions [T], attention metadata, logits row indices [R]).

        Token order: each decode sequence's pending token and drafts, then each prefill chunk.
        Logits rows: every decode token, then per prefill chunk the positions scoring its prompt's
        log-probs (`rollout.logprobs.prompt_rows`, when asked) and the last token of a chunk that
        completes its sequence's pending tokens (matches `Scheduler.finish_step`)."""
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        decode_rows: list[int] = []
        drafting = any(seq.draft for seq in batch.decode)
        if drafting:
            for seq in batch.decode:  # the pending token, then the drafted tokens to verify
                tokens = [seq.token_ids[seq.num_computed], *seq.draft]
                ids.extend(tokens)
                positions.extend(range(seq.num_computed, seq.num_computed + len(tokens)))
                decode_rows.extend([seq.row] * len(tokens))
        else:  # one pending token each
            ids = [seq.token_ids[seq.num_computed] for seq in batch.decode]
            positions = [seq.num_computed for seq in batch.decode]
            decode_rows = [seq.row for seq in batch.decode]
        logits_rows = list(range(len(ids)))
        decode_meta = self._decode_metadata(batch.decode, drafting) if batch.decode else None
        if not batch.decode and self.suffix_lanes is not None:
            self.suffix_lanes.forget()  # lanes are kept only across consecutive decode steps
        out_slots = [
            self.slot_table[
                torch.tensor(decode_rows, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
            ]
        ]

        segments: list[PrefillSegment] = []
        for seq, num_new in batch.prefill:
            start, end = seq.num_computed, seq.num_computed + num_new
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            context = self.slot_table[seq.row, :end]
            token_start = len(ids) - num_new
            segments.append(PrefillSegment(token_start, num_new, context, prefix_len=start))
            out_slots.append(context[start:end])
            if scored := prompt_rows(seq, start, end):
                logits_rows.extend(range(token_start, token_start + scored))
            if end == len(seq.token_ids):
                logits_rows.append(len(ids) - 1)

        meta = AttentionMetadata(
            out_slots=torch.cat(out_slots), decode=decode_meta, prefill=tuple(segments)
        )
        return StepPlan(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=device),
        )

    def _decode_metadata(self, batch_seqs: list[Sequence], drafting: bool) -> DecodeMetadata:
        """Group decode sequences by the radix node whose pages start their context (forks of
        one prompt share it); a sequence without cached pages is a group of its own.
        `drafting`: whether any sequence holds a draft (else one query each).

        The [D, Q] grid lists the sequences in lane order when suffix lanes are used (so attention
        reads the lanes in place), else in batch order; `query_index` / `token_cell` map between
        grid cells and batch rows either way."""
        device, page_size = self.device, self.page_size
        lanes = self.suffix_lanes
        plan = lanes.plan(batch_seqs, drafting) if lanes is not None else None
        in_order = plan is None or plan.in_order  # grid position i holds batch index i
        order = range(len(batch_seqs)) if in_order else plan.order  # grid position -> batch index
        seqs = batch_seqs if in_order else [batch_seqs[i] for i in order]
        # The layout depends only on which sequences decode, in which batch and grid order, their
        # page tables before the suffix (named by kv_epoch: it changes whenever those change)
        # and their query counts: consecutive one-query steps of a steady batch reuse it (the
        # engine's runner; a draft model's sequences carry no epochs).
        reuse = plan is not None and not drafting
        key = (plan.epochs, list(order)) if reuse else None
        if reuse and self._steady is not None and self._steady[0] == key:
            layout = self._steady[1]
        else:
            layout = self._layout(batch_seqs, seqs, order, plan is not None)
            self._steady = (key, layout) if reuse else None

        # Suffix: each sequence's tokens after its group prefix, this step's queries included;
        # `computed` of them are in the pool already.
        if plan is not None:  # the lanes hold the suffixes: attention reads no suffix pages
            suffix_pages, width = None, plan.width
            computed = plan.computed if in_order else [plan.computed[i] for i in order]
        else:
            seq_prefix = [s.num_tree_pages * page_size for s in seqs]
            computed = [s.num_computed - p for s, p in zip(seqs, seq_prefix)]
            ends = [c + 1 + len(s.draft) for c, s in zip(computed, seqs)]
            suffix_pages = self._pages_of([s.row for s in seqs], seq_prefix, ends)
            width = suffix_pages.shape[1] * page_size
        # Query j of a sequence sees its suffix up to and including itself; padding cells
        # repeat the sequence's last query.
        if drafting:
            num_queries = [1 + len(s.draft) for s in seqs]
            num_q = torch.tensor(num_queries, device=device)
            j = torch.minimum(torch.arange(max(num_queries), device=device), num_q[:, None] - 1)
            limits = torch.tensor(computed, device=device).unsqueeze(-1) + j + 1  # [D, Q]
        else:  # one query each: Q = 1
            limits = torch.tensor(computed, device=device).add_(1).unsqueeze(-1)
        suffix_bias = self._visible(limits.unsqueeze(-1), width)
        return DecodeMetadata(
            layout.prefix_pages,
            layout.prefix_bias,
            layout.member_index,
            layout.group_size,
            suffix_pages,
            suffix_bias,  # [D, Q, Ls]
            layout.query_index,
            layout.token_cell,
            lane_write=plan.write_index if plan is not None else None,
            prefix_key=layout.prefix_key,
            members_in_order=layout.members_in_order,
            grid_is_batch=layout.grid_is_batch,
        )

    def _layout(
        self, batch_seqs: list[Sequence], seqs: list[Sequence], order, lanes: bool
    ) -> _Layout:
        """The decode grid's groups, their prefixes and the grid <-> batch maps (with `lanes`,
        the key of the lanes' prefix copies too)."""
        device, page_size = self.device, self.page_size
        groups: dict[object, list[int]] = {}
        for i, seq in enumerate(seqs):
            key = id(seq.node) if seq.num_tree_pages else ("alone", i)
            groups.setdefault(key, []).append(i)
        group_size = max(len(members) for members in groups.values())
        member_index = [0] * len(seqs)
        prefix_rows, prefix_lens = [], []
        for g, members in enumerate(groups.values()):
            for m, i in enumerate(members):
                member_index[i] = g * group_size + m
            prefix_rows.append(seqs[members[0]].row)
            prefix_lens.append(seqs[members[0]].num_tree_pages * page_size)
        prefix_pages = self._pages_of(prefix_rows, [0] * len(prefix_rows), prefix_lens)
        lens = torch.tensor(prefix_lens, device=device).unsqueeze(-1)
        # Columns past a shorter prefix name page 0 (masked by prefix_bias), not whatever the
        # leader's row holds there: the layout depends on the prefixes alone.
        past = torch.arange(prefix_pages.shape[1], device=device) * page_size >= lens
        prefix_pages.masked_fill_(past, 0)
        prefix_bias = self._visible(lens, prefix_pages.shape[1] * page_size)
        width_q = max(1 + len(s.draft) for s in seqs)
        num_q = torch.tensor([1 + len(s.draft) for s in seqs], device=device)
        j = torch.minimum(torch.arange(width_q, device=device), num_q.unsqueeze(-1) - 1)
        # Batch row of each sequence's first query (decode tokens are in batch order).
        batch_q = [1 + len(s.draft) for s in batch_seqs]
        batch_start = torch.tensor([0, *batch_q[:-1]], device=device).cumsum(0)
        order_t = torch.tensor(list(order), device=device)
        grid_of = torch.empty_like(order_t)  # batch index -> grid position
        grid_of[order_t] = torch.arange(len(seqs), device=device)
        query_index = (batch_start[order_t].unsqueeze(-1) + j).reshape(-1)
        # Grid cell of each decode token, in batch order: cells [q0, q0 + count) of its sequence.
        counts = torch.tensor(batch_q, device=device)
        token_seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), counts)
        token_cell = (
            grid_of[token_seq] * width_q
            + torch.arange(len(token_seq), device=device)
            - batch_start[token_seq]
        )
        return _Layout(
            prefix_pages,
            prefix_bias,
            torch.tensor(member_index, device=device),
            group_size,
            query_index,
            token_cell,
            tuple((seqs[m[0]].kv_epoch, seqs[m[0]].num_tree_pages) for m in groups.values())
            if lanes
            else None,
            len(groups) * group_size == len(seqs) and member_index == list(range(len(seqs))),
            width_q == 1 and list(order) == list(range(len(seqs))),
        )

    def _pages_of(self, rows: list[int], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """Pages holding positions [start, start + length) of each row (starts are page
        aligned)."""
        device, page_size = self.device, self.page_size
        num_pages = -(-max(lengths) // page_size)
        cols = (
            torch.tensor(starts, device=device).unsqueeze(-1)
            + torch.arange(num_pages, device=device) * page_size
        )
        cols.clamp_(max=self.slot_table.shape[1] - 1)
        return self.slot_table[torch.tensor(rows, device=device).unsqueeze(-1), cols] // page_size

    def _visible(self, limits: torch.Tensor, width: int) -> torch.Tensor:
        """Additive mask: 0 for token offsets below `limits` [..., 1], -inf from there on."""
        device = self.device
        bias = torch.zeros(*limits.shape[:-1], width, device=device, dtype=torch.float32)
        return bias.masked_fill_(torch.arange(width, device=device) >= limits, float("-inf"))

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits (float64 for a float64 model): one row per decode token (pending +
        drafts), then one per prefill that completed its sequence's pending tokens."""
        return execute(self.model, self.attention, self.prepare(batch))
