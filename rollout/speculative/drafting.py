"""The scheduler's side of speculative decoding: which decoding sequences draft how many tokens
this step, and what a verify pass leaves behind (tokens to append, K/V now valid, stats).

Drafting backs off per sequence when its drafts keep failing (`DraftBackoff`): a wasted draft
costs a verify pass over k + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from rollout.speculative.verify import verify

if TYPE_CHECKING:
    from rollout.scheduler.stats import SchedulerStats
    from rollout.sequence import Sequence


class Draft(NamedTuple):
    tokens: list[int]
    # [len(tokens), V]: the distribution each token was drawn from; None = point mass
    probs: torch.Tensor | None


NO_DRAFT = Draft([], None)


class DraftProposer(Protocol):
    """What drafting needs from a speculative proposer (lookup or draft model)."""

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]: ...
    def forget(self, seq: Sequence) -> None: ...


@dataclass
class DraftBackoff:
    """Per-sequence pause in drafting after verify steps that accept too little.

    A verify step accepting less than `min_acceptance` of its draft doubles the pause (1, 2, 4, ...
    up to `max_pause` decode steps without drafting); one that meets it ends the pause. A sequence
    whose drafts never land thus drafts on ~1 step in `max_pause`; one that recovers is back at
    once. min_acceptance = 0 never pauses."""

    min_acceptance: float
    max_pause: int = 64
    pause: int = 0  # length of the current (or last) pause
    skip: int = 0  # decode steps left without drafting

    def should_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if drafted and accepted < self.min_acceptance * drafted:
            self.pause = min(max(1, 2 * self.pause), self.max_pause)
            self.skip = self.pause
        else:
            self.pause = 0


class Speculation(NamedTuple):
    """Speculative decoding's settings, as the scheduler takes them."""

    proposer: DraftProposer
    num_tokens: int  # drafted per sequence and step, at most
    min_acceptance: float  # see DraftBackoff


class Emitted(NamedTuple):
    """What one verified sequence appends: accepted drafts, then a corrected or bonus token."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float]


class Drafting:
    """Drafts for the scheduler's decoding sequences, and the bookkeeping of their verification.

    A sequence's back-off lives here, keyed by `seq.order` (unique over the engine's life, kept
    across preemption, new for every fork), from its first decode step until it finishes."""

    def __init__(self, speculation: Speculation, stats: SchedulerStats):
        self.proposer, self.num_tokens, self.min_acceptance = speculation
        self.stats = stats
        self._backoffs: dict[tuple[int, int], DraftBackoff] = {}

    def draft(self, decoding: list[Sequence]) -> None:
        """Set `draft` / `draft_probs` of every decoding sequence: a speculated continuation,
        never past its token limits, or nothing (its first token, drawn at the fork; or backing
        off)."""
        ks = []
        for seq in decoding:
            backoff = self._backoffs.get(seq.order)
            if backoff is None:
                backoff = self._backoffs[seq.order] = DraftBackoff(self.min_acceptance)
            # a verify pass emits its accepted drafts and one more token: all must fit before
            # the sequence's end (max_new_tokens or max_model_len)
            room = seq.request.end_len - len(seq.token_ids) - 1
            k = min(self.num_tokens, room) if seq.num_generated > 0 else 0
            if k > 0 and not backoff.should_draft():
                self.stats.spec_backoff_steps += 1
                k = 0
            ks.append(k)
        drafts = (
            self.proposer.propose_batch(decoding, ks) if any(ks) else [NO_DRAFT] * len(decoding)
        )
        for seq, (tokens, probs) in zip(decoding, drafts):
            seq.draft, seq.draft_probs = tokens, probs

    def verify(self, speculated: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[Emitted]:
        """Verify the drafts of `speculated` (sequence, its first logits row: the pending token's,
        then one per draft). Each sequence's K/V is then valid for its pending token and the
        accepted drafts; its draft is cleared; the tokens to append are returned."""
        rows = torch.cat([torch.arange(r, r + 1 + len(s.draft)) for s, r in speculated])
        seqs = [s for s, _ in speculated]
        stats, emitted = self.stats, []
        for seq, result in zip(seqs, verify(logits[rows.to(logits.device)], seqs)):
            stats.spec_verify_steps += 1
            stats.spec_draft_tokens += len(seq.draft)
            stats.spec_accepted_tokens += result.num_accepted
            self._backoffs[seq.order].record(len(seq.draft), result.num_accepted)
            seq.num_computed += 1 + result.num_accepted
            seq.draft, seq.draft_probs = [], None
            emitted.append(Emitted(seq, result.tokens, result.logprobs))
        return emitted

    def forget(self, seq: Sequence) -> None:
        """`seq` finished (or was aborted): its back-off and the proposer's state of it go."""
        self._backoffs.pop(seq.order, None)
        self.proposer.forget(seq)

    def check_integrity(self, live: list[Sequence]) -> None:
        """Back-offs are held for unfinished sequences only."""
        orders = {s.order for s in live}
        assert self._backoffs.keys() <= orders, "a finished sequence's back-off was kept"
