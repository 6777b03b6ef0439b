"""Turns a scheduled batch into tensors, runs the model, and returns the logits to sample from."""

from __future__ import annotations

import torch

from rollout.attention import AttentionMetadata, DecodeMetadata, PrefillSegment, TorchAttention
from rollout.model import CausalLM
from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, attention: TorchAttention, slot_table: torch.Tensor, page_size: int):
        self.model = model
        self.page_size = page_size
        self.attention = attention
        self.slot_table = slot_table   # owned by the scheduler: (row, position) -> KV slot
        self.device = slot_table.device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids [T], positions [T], attention metadata, logits row indices [R]).

        Token order: one token per decode sequence, then each prefill chunk. Logits rows: every
        decode token, then the last token of each chunk that completes its sequence's pending
        tokens (matches `Scheduler.finish_step`)."""
        device = self.device
        ids: list[int] = [s.token_ids[s.num_computed] for s in batch.decode]
        positions: list[int] = [s.num_computed for s in batch.decode]
        num_decode = len(batch.decode)
        logits_rows = list(range(num_decode))

        decode_meta = self._decode_metadata(batch.decode) if num_decode else None
        out_slots = [self.slot_table[torch.tensor([s.row for s in batch.decode], dtype=torch.int64, device=device),
                                     torch.tensor(positions, dtype=torch.int64, device=device)]]

        segments: list[PrefillSegment] = []
        for seq, num_new in batch.prefill:
            start, end = seq.num_computed, seq.num_computed + num_new
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            context = self.slot_table[seq.row, :end]
            query_pos = torch.arange(start, end, device=device).unsqueeze(-1)
            mask = torch.arange(end, device=device).unsqueeze(0) <= query_pos   # causal, offset by prefix
            token_start = len(ids) - num_new
            segments.append(PrefillSegment(token_start, num_new, context, mask))
            out_slots.append(context[start:end])
            if end == len(seq.token_ids):
                logits_rows.append(len(ids) - 1)

        meta = AttentionMetadata(out_slots=torch.cat(out_slots), decode=decode_meta, prefill=tuple(segments))
        return (torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                meta,
                torch.tensor(logits_rows, dtype=torch.int64, device=device))

    def _decode_metadata(self, seqs: list[Sequence]) -> DecodeMetadata:
        """Group decode sequences by the radix node whose pages start their context (forks of
        one prompt share it); a sequence without cached pages is a group of its own."""
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

        def paged(rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor):
            """Pages holding positions [start, start + length) of each row (starts are page
            aligned), and the additive mask over their tokens."""
            num_pages = -(-int(lengths.max()) // page_size)
            cols = (starts.unsqueeze(-1) + torch.arange(num_pages, device=device) * page_size)
            cols.clamp_(max=self.slot_table.shape[1] - 1)
            pages = self.slot_table[rows.unsqueeze(-1), cols] // page_size
            offsets = torch.arange(num_pages * page_size, device=device)
            bias = torch.zeros(len(rows), num_pages * page_size, device=device, dtype=torch.float32)
            bias.masked_fill_(offsets >= lengths.unsqueeze(-1), float("-inf"))
            return pages, bias

        prefix_lens_t = torch.tensor(prefix_lens, device=device)
        prefix_pages, prefix_bias = paged(torch.tensor(prefix_rows, device=device),
                                          torch.zeros_like(prefix_lens_t), prefix_lens_t)
        seq_prefix = torch.tensor([s.num_tree_pages * page_size for s in seqs], device=device)
        suffix_lens = torch.tensor([s.num_computed + 1 for s in seqs], device=device) - seq_prefix
        suffix_pages, suffix_bias = paged(torch.tensor([s.row for s in seqs], device=device), seq_prefix, suffix_lens)
        return DecodeMetadata(prefix_pages, prefix_bias, torch.tensor(member_index, device=device), group_size,
                              suffix_pages, suffix_bias)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits, one row per sequence that completed its pending tokens."""
        input_ids, positions, meta, logits_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.attention, meta)
        return self.model.compute_logits(hidden[logits_rows])
