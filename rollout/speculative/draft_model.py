"""Draft-model speculation: a smaller model with the target's vocabulary proposes k tokens.

The draft model runs through the engine's own model code and attention, over a paged KV pool of
its own: one slot-table row and private pages per drafting sequence, no prefix sharing (each
sample computes its prompt in the draft model once; the draft model is small). Its K/V of a
sequence stays valid across steps up to the longest common prefix of what it computed and what
the sequence kept, so rejected drafts are rolled back by forgetting positions, never by copying.

Drafts are *sampled* from the draft model's distribution q at the request's temperature and
truncation (greedy requests: its argmax), with the sequence's own generator, and q travels with
the draft so that `rollout.speculative.verify.verify` applies the exact rule min(1, p / q).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_spec import ModelSpec
from rollout.attention import TorchAttention
from rollout.kv_pool import KVPool, write_page_slots
from rollout.model import CausalLM
from rollout.model_runner import ModelRunner
from rollout.scheduler import ScheduledBatch
from rollout.sequence import Sequence
from rollout.speculative.drafting import NO_DRAFT, Draft
from rollout.speculative.verify import draw, draw_uniform, sampling_distribution
from rollout.weights import iter_safetensors, load_weights


@dataclass(eq=False)
class _DraftState:
    """The draft model's view of one sequence, with the fields `ModelRunner` reads from a
    Sequence."""

    row: int
    token_ids: list[int] = field(
        default_factory=list
    )  # the sequence's tokens, then this step's drafts
    num_computed: int = 0  # draft K/V is valid for token_ids[:num_computed]
    synced: int = 0  # token_ids[:synced] are known to equal the sequence's
    pages: list[int] = field(default_factory=list)
    # As a Sequence that verifies nothing and shares no cached prefix.
    draft = ()
    num_tree_pages = 0
    node = None


class DraftModelProposer:
    def __init__(
        self,
        model_dir: str,
        *,
        vocab_size: int,
        max_model_len: int,
        max_sequences: int,
        kv_tokens: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(
                f"EngineConfig.speculative_draft_model_path={model_dir!r} is not a directory; "
                "give the local Hugging Face directory of the draft model"
            )
        self.model_config = mc = ModelSpec.from_dir(path)
        if mc.vocab_size != vocab_size:
            raise ValueError(
                f"EngineConfig.speculative_draft_model_path: the draft model's vocab_size "
                f"{mc.vocab_size} differs from the target's {vocab_size}; a draft model must share "
                "the target's tokenizer"
            )
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(
                "EngineConfig.speculative_draft_model_path: the draft model's "
                f"max_position_embeddings {mc.max_position_embeddings} is below "
                f"max_model_len={max_model_len}; lower max_model_len"
            )
        self.model = CausalLM.build(mc, max_model_len, dtype, device)
        load_weights(
            self.model,
            iter_safetensors(path),
            tied_embeddings=mc.tie_word_embeddings,
            require_all=True,
        )
        self.page_size = page_size
        self.pool = KVPool(
            num_layers=mc.num_layers,
            num_pages=max(1, -(-kv_tokens // page_size)),
            page_size=page_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=device,
        )
        self.slot_table = torch.zeros(
            (max_sequences, max_model_len), dtype=torch.int64, device=device
        )
        self.runner = ModelRunner(self.model, TorchAttention(self.pool), self.slot_table, page_size)
        self._states: OrderedDict[Sequence, _DraftState] = (
            OrderedDict()
        )  # least recently drafted first
        self._free_rows = list(range(max_sequences - 1, -1, -1))
        self.evictions = (
            0  # draft K/V dropped to make room (recomputed if that sequence drafts again)
        )

    # -- proposing -----------------------------------------------------------------------------
    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] drafted tokens per sequence, all sequences advanced together: one draft-model
        forward per drafted position (the first also catches up on the sequence's new tokens)."""
        drafts = [NO_DRAFT] * len(seqs)
        in_use = {seq for seq, k in zip(seqs, ks) if k > 0}
        work: list[tuple[int, Sequence, _DraftState, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            state = self._state(seq, in_use)
            if state is None:
                continue
            self._sync(state, seq.token_ids)
            # K/V for every known token and the first k - 1 drafts (the last draft is never fed
            # back).
            if self._reserve(state, len(seq.token_ids) + k - 1, in_use):
                work.append((i, seq, state, k))
        tokens: dict[int, list[int]] = {i: [] for i, *_ in work}
        dists: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in work}
        active = work
        while active:
            decode = [st for _, _, st, _ in active if len(st.token_ids) - st.num_computed == 1]
            prefill = [
                (st, len(st.token_ids) - st.num_computed)
                for _, _, st, _ in active
                if len(st.token_ids) - st.num_computed > 1
            ]
            logits = self.runner.run(ScheduledBatch(decode, prefill))
            # Logits rows come in batch order: decodes, then prefills.
            row_of = {id(st): r for r, st in enumerate(decode + [st for st, _ in prefill])}
            logits = logits[
                torch.tensor([row_of[id(st)] for _, _, st, _ in active], device=logits.device)
            ]
            params = [seq.request.params for _, seq, _, _ in active]
            _, q = sampling_distribution(logits, params)
            drawn = draw(
                q,
                [
                    0.0 if p.greedy else draw_uniform(seq)
                    for (_, seq, _, _), p in zip(active, params)
                ],
            )
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            # one read back per drafted position, whatever the batch: the next step's input ids
            chosen = torch.where(greedy, logits.argmax(dim=-1), drawn).tolist()
            for j, ((i, _, state, _), p) in enumerate(zip(active, params)):
                state.num_computed = len(state.token_ids)
                token = chosen[j]
                state.token_ids.append(token)
                tokens[i].append(token)
                if not p.greedy:
                    dists[i].append(q[j])
            active = [w for w in active if len(tokens[w[0]]) < w[3]]
        for i, _, _, _ in work:
            probs = torch.stack(dists[i]) if dists[i] else None  # greedy drafts are point masses
            drafts[i] = Draft(tokens[i], probs)
        return drafts

    def forget(self, seq: Sequence) -> None:
        state = self._states.pop(seq, None)
        if state is not None:
            self.pool.free_pages(state.pages)
            self._free_rows.append(state.row)

    # -- state and pages -----------------------------------------------------------------------
    def _state(self, seq: Sequence, in_use: set[Sequence]) -> _DraftState | None:
        state = self._states.get(seq)
        if state is not None:
            self._states.move_to_end(seq)
            return state
        if not self._free_rows and not self._evict_one(in_use):
            return None
        state = self._states[seq] = _DraftState(self._free_rows.pop())
        return state

    @staticmethod
    def _sync(state: _DraftState, tokens: list[int]) -> None:
        """Make state.token_ids the sequence's tokens, keeping K/V up to their common prefix."""
        n, limit = state.synced, min(state.num_computed, len(tokens))
        while n < limit and state.token_ids[n] == tokens[n]:
            n += 1
        state.num_computed = min(state.num_computed, n)
        state.token_ids[n:] = tokens[n:]
        state.synced = len(tokens)

    def _reserve(self, state: _DraftState, num_tokens: int, in_use: set[Sequence]) -> bool:
        """Pages for K/V of `num_tokens` positions; evicts other sequences' draft K/V (least
        recently drafted first, never one drafting this step). False if there is no room."""
        need = -(-num_tokens // self.page_size) - len(state.pages)
        if need <= 0:
            return True
        while self.pool.num_free_pages < need:
            if not self._evict_one(in_use):
                return False
        first = len(state.pages)
        state.pages.extend(self.pool.alloc_pages(need))
        write_page_slots(self.slot_table, state.row, state.pages, first, self.page_size)
        return True

    def _evict_one(self, in_use: set[Sequence]) -> bool:
        victim = next((seq for seq in self._states if seq not in in_use), None)
        if victim is None:
            return False
        self.forget(victim)
        self.evictions += 1
        return True

    # -- memory --------------------------------------------------------------------------------
    def release(self) -> int:
        """Drop every sequence's draft K/V and the pool (nothing is in flight). Returns bytes freed;
        the draft model's weights stay (weight updates never touch them)."""
        for seq in list(self._states):
            self.forget(seq)
        if not self.pool.allocated:
            return 0
        released = 2 * self.pool.k.numel() * self.pool.k.element_size()
        self.pool.free_memory()
        self.runner.forget_plan()
        return released

    def resume(self) -> None:
        if not self.pool.allocated:
            self.pool.allocate()

    def check_integrity(self) -> None:
        """free + held pages == total, each page in one place; rows likewise."""
        held = [p for state in self._states.values() for p in state.pages]
        everything = self.pool.free_page_ids() + held
        assert sorted(everything) == list(range(self.pool.num_pages)), (
            "draft KV pages leaked or doubly held"
        )
        for state in self._states.values():
            assert len(state.pages) * self.page_size >= state.num_computed, (
                "draft K/V without pages"
            )
        rows = self._free_rows + [state.row for state in self._states.values()]
        assert sorted(rows) == list(range(self.slot_table.shape[0])), "draft slot-table rows leaked"
