"""Draft proposers for speculative decoding, and exact verification of drafts.

Proposers guess the next tokens of a sequence; the target model then scores the pending token
plus k drafted ones in one forward pass, and `verify` accepts a prefix of the draft so that the
emitted tokens are distributed exactly as if sampled one by one from the target (Leviathan et
al., 2023). With p the target's (temperature-scaled, truncated) distribution at a position and q
the distribution the draft token d was drawn from: accept d with probability min(1, p(d) / q(d));
on the first rejection draw from max(0, p - q), renormalised; if every draft is accepted draw one
bonus token from the next p. Lookup proposers give point-mass drafts (q = one-hot on d), for which
this is: accept with probability p(d), else draw from p with d removed. At temperature 0, p is
one-hot on the argmax: a draft is accepted iff it equals the greedy token, so greedy output is
unchanged token for token.

Proposers:
* `ngram` (prompt lookup): the sequence's own prompt and completion;
* `group`: additionally the other samples of the same prompt and earlier completions of it, the
  redundancy GRPO creates (n samples of one prompt repeat each other, more so as the policy
  sharpens). All share one `SuffixIndex` per prompt.
* `draft`: a smaller model with the same vocabulary samples the draft (`rollout.draft_model`).

Drafting backs off per sequence when its drafts keep failing (`DraftBackoff`): a wasted draft
costs a verify pass over k + 1 tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from rollout.config import SamplingParams
from rollout.sampler import truncation_mask

if TYPE_CHECKING:
    from rollout.sequence import Sequence

PROPOSERS = ("ngram", "group")  # lookup proposers; "draft" lives in rollout.draft_model


class Draft(NamedTuple):
    tokens: list[int]
    probs: (
        torch.Tensor | None
    )  # [len(tokens), V]: the distribution each token was drawn from; None = point mass


NO_DRAFT = Draft([], None)


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


class Verified(NamedTuple):
    tokens: list[int]  # accepted drafts, then one corrected or bonus token
    logprobs: list[float]  # log_softmax(logits / T) of each, before truncation
    num_accepted: int


def sampling_distribution(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (log_softmax(logits / T) over the full vocabulary, the distribution tokens are drawn
    from: softmax(logits / T) truncated by top-k / top-p / min-p and renormalised). Greedy rows use
    T = 1 here (their draw is the argmax)."""
    device = logits.device
    temperature = torch.tensor(
        [p.temperature if not p.greedy else 1.0 for p in params], device=device
    )
    logprobs_all = torch.log_softmax(logits / temperature.to(logits.dtype).unsqueeze(-1), dim=-1)
    probs = logprobs_all.exp()
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    truncating = ((top_k > 0) & (top_k < probs.shape[-1])) | (top_p < 1) | (min_p > 0)
    if truncating.any():
        rows = truncating.nonzero().squeeze(-1)
        probs[rows] = probs[rows] * truncation_mask(
            probs[rows], top_k[rows], top_p[rows], min_p[rows]
        )
    return logprobs_all, probs / probs.sum(dim=-1, keepdim=True)


def draw(weights: torch.Tensor, uniforms: list[float]) -> list[int]:
    """One inverse-CDF draw per row of non-negative `weights` [R, V] (need not be normalised), in
    vocabulary order, as the sampler does."""
    weights = weights.double()
    cdf = weights.cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=weights.device)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    chosen = torch.minimum(
        chosen, (cdf < cdf[:, -1:]).sum(dim=-1)
    )  # rounding guard: last positive token
    return chosen.tolist()


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[Verified]:
    """Exact verification of drafts for a batch of sequences.

    logits: [sum(len(s.draft) + 1), V]; sequence s owns len(s.draft) + 1 consecutive rows, row i
    scoring the token after s.draft[:i]. `s.draft_probs` is the draft's q ([len(draft), V]) or None
    for a point-mass draft. All tensor work is batched over rows; only the accept/reject walk along
    each draft is a Python loop over scalars."""
    device = logits.device
    num_rows = [len(s.draft) + 1 for s in seqs]
    starts = [0, *itertools.accumulate(num_rows)][:-1]
    params = [s.request.params for s in seqs]
    logprobs_all, probs = sampling_distribution(
        logits, [p for p, n in zip(params, num_rows) for _ in range(n)]
    )
    greedy_tokens = logits.argmax(dim=-1).tolist()
    # p(d) and q(d) of every drafted token (q = 1 for point masses).
    draft_rows = [start + i for seq, start in zip(seqs, starts) for i in range(len(seq.draft))]
    draft_tokens = [t for seq in seqs for t in seq.draft]
    p_draft = probs[
        torch.tensor(draft_rows, dtype=torch.int64, device=device),
        torch.tensor(draft_tokens, dtype=torch.int64, device=device),
    ].tolist()
    q_draft = [
        q
        for seq in seqs
        for q in (
            [1.0] * len(seq.draft)
            if seq.draft_probs is None
            else seq.draft_probs[torch.arange(len(seq.draft)), torch.tensor(seq.draft)].tolist()
        )
    ]

    accepted_counts: list[int] = []
    residuals: list[
        tuple[int, torch.Tensor | int | None]
    ] = []  # (row to draw from, what to subtract)
    uniforms: list[float] = []
    k = 0
    for seq, param, start in zip(seqs, params, starts):
        accepted = 0
        for i, token in enumerate(seq.draft):
            if param.greedy:
                ok = token == greedy_tokens[start + i]
            else:  # u < p / q, without dividing
                ok = draw_uniform(seq) * q_draft[k + i] < p_draft[k + i]
            if not ok:
                break
            accepted += 1
        k += len(seq.draft)
        accepted_counts.append(accepted)
        row = start + accepted
        if param.greedy or accepted == len(seq.draft):  # greedy, or a bonus token from the next p
            residuals.append((row, None))
        elif seq.draft_probs is None:  # p without the rejected point-mass draft
            residuals.append((row, seq.draft[accepted]))
        else:  # max(0, p - q)
            residuals.append((row, seq.draft_probs[accepted]))
        uniforms.append(-1.0 if param.greedy else draw_uniform(seq))

    # One batched inverse-CDF draw for every sequence's final token.
    weights = probs[
        torch.tensor([r for r, _ in residuals], dtype=torch.int64, device=device)
    ].double()
    for i, (_, subtract) in enumerate(residuals):
        if isinstance(subtract, int):
            weights[i, subtract] = 0.0
        elif subtract is not None:
            residual = (weights[i] - subtract.to(device=device, dtype=torch.float64)).clamp_(
                min=0.0
            )
            # A rejection implies p(d) < q(d), so some token has p > q; rounding aside.
            if residual.sum() > 0:
                weights[i] = residual
    final = draw(weights, [max(u, 0.0) for u in uniforms])

    results = []
    for seq, param, start, accepted, (row, _), drawn in zip(
        seqs, params, starts, accepted_counts, residuals, final
    ):
        last = greedy_tokens[row] if param.greedy else drawn
        tokens = seq.draft[:accepted] + [last]
        token_rows = torch.arange(start, start + len(tokens), device=device)
        logprobs = logprobs_all[token_rows, torch.tensor(tokens, device=device)].tolist()
        results.append(Verified(tokens, logprobs, accepted))
    return results


def draw_uniform(seq: Sequence) -> float:
    """One uniform in [0, 1) from the sequence's own generator."""
    return seq.uniforms.draw()
