"""Turns a scheduled batch into tensors, runs the model, and returns the logits to sample from."""

from __future__ import annotations

import torch

from rollout.attention import AttentionMetadata, PrefillSegment, TorchAttention
from rollout.model import CausalLM
from rollout.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: CausalLM, attention: TorchAttention, slot_table: torch.Tensor):
        self.model = model
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

        if num_decode:
            rows = torch.tensor([s.row for s in batch.decode], device=device)
            pos = torch.tensor(positions, device=device)
            width = int(max(positions)) + 1
            decode_slots = self.slot_table[rows, :width]
            decode_mask = (torch.arange(width, device=device) <= pos.unsqueeze(-1)).view(num_decode, 1, 1, width)
            decode_out = self.slot_table[rows, pos]
        else:
            decode_slots = torch.zeros((0, 1), dtype=torch.int64, device=device)
            decode_mask = torch.zeros((0, 1, 1, 1), dtype=torch.bool, device=device)
            decode_out = torch.zeros(0, dtype=torch.int64, device=device)

        segments: list[PrefillSegment] = []
        out_slots = [decode_out]
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

        meta = AttentionMetadata(
            out_slots=torch.cat(out_slots),
            num_decode=num_decode,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefill=tuple(segments),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                meta,
                torch.tensor(logits_rows, dtype=torch.int64, device=device))

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits, one row per sequence that completed its pending tokens."""
        input_ids, positions, meta, logits_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.attention, meta)
        return self.model.compute_logits(hidden[logits_rows])
