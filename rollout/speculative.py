"""Draft proposers for speculative decoding, and exact verification of drafts.

Proposers guess the next tokens of a sequence from text it has already seen; the target model
then scores the pending token plus k drafted ones in one forward pass, and `verify` accepts a
prefix of the draft so that the emitted tokens are distributed exactly as if sampled one by one
from the target (Leviathan et al., 2023). A proposer here returns point-mass drafts (one token per
position, probability 1), for which the rule is: accept draft d with probability p(d), where p is
the target's (temperature-scaled, truncated) distribution; on the first rejection draw from p with
d removed and renormalised; if every draft is accepted draw one bonus token from the next p.
At temperature 0, p is one-hot on the argmax: a draft is accepted iff it equals the greedy token,
so greedy output is unchanged token for token.

Proposers:
* `ngram` (prompt lookup): the sequence's own prompt and completion;
* `group`: additionally the other samples of the same prompt and earlier completions of it, the
  redundancy GRPO creates (n samples of one prompt repeat each other, more so as the policy
  sharpens). All share one `SuffixIndex` per prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

import torch

from rollout.sampler import truncation_mask

if TYPE_CHECKING:
    from rollout.sequence import Sequence

PROPOSERS = ("ngram", "group")


class SuffixIndex:
    """n-gram -> where it last continued, over one or more growing token lists ("sources").

    For every position p of a source and every n in [min_n, max_n], key tuple(tokens[p-n:p])
    maps to (source, p): "after these n tokens came tokens[p:]". A lookup tries the longest n
    first and proposes what followed the latest occurrence."""

    def __init__(self, min_n: int, max_n: int, max_sources: int = 256):
        self.min_n, self.max_n = min_n, max_n
        self.max_sources = max_sources
        self._sources: OrderedDict[int, list[int]] = OrderedDict()   # source id -> its token list
        self._indexed: dict[int, int] = {}                           # source id -> positions indexed
        self._table: dict[tuple[int, ...], tuple[int, int]] = {}

    def update(self, source_id: int, tokens: list[int]) -> None:
        """Index the positions of `tokens` not yet seen (the list is kept by reference)."""
        if source_id not in self._sources:
            if len(self._sources) >= self.max_sources:       # forget the oldest source's entries lazily
                old, _ = self._sources.popitem(last=False)
                self._indexed.pop(old, None)
            self._sources[source_id] = tokens
            self._indexed[source_id] = 0
        start = self._indexed[source_id]
        # Position p is indexed once tokens[p] exists (so a hit always has a continuation).
        for p in range(max(start, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self._table[tuple(tokens[p - n:p])] = (source_id, p)
        self._indexed[source_id] = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._table.get(tuple(tokens[len(tokens) - n:]))
            if hit is None:
                continue
            source = self._sources.get(hit[0])
            if source is not None:
                return source[hit[1]:hit[1] + k]
        return []


class Proposer:
    """Keeps one SuffixIndex per sequence (`ngram`) or per prompt (`group`)."""

    def __init__(self, method: str, min_n: int = 1, max_n: int = 4, max_indexes: int = 4096):
        if method not in PROPOSERS:
            raise ValueError(f"EngineConfig.speculative_method={method!r}: choose one of {PROPOSERS}")
        self.method = method
        self.min_n, self.max_n = min_n, max_n
        self.max_indexes = max_indexes
        self._indexes: OrderedDict[object, SuffixIndex] = OrderedDict()

    def _index(self, seq: "Sequence") -> SuffixIndex:
        key = tuple(seq.request.prompt) if self.method == "group" else id(seq)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = SuffixIndex(self.min_n, self.max_n)
            while len(self._indexes) > self.max_indexes:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(key)
        return index

    def propose(self, seq: "Sequence", k: int) -> list[int]:
        index = self._index(seq)
        index.update(id(seq), seq.token_ids)
        return index.propose(seq.token_ids, k) if k > 0 else []

    def forget(self, seq: "Sequence") -> None:
        """A sequence finished: `ngram` drops its index; `group` keeps it as an earlier completion."""
        if self.method == "ngram":
            self._indexes.pop(id(seq), None)
        else:
            self._index(seq).update(id(seq), seq.token_ids)


class Verified(NamedTuple):
    tokens: list[int]       # accepted drafts, then one corrected or bonus token
    logprobs: list[float]   # log_softmax(logits / T) of each, before truncation
    num_accepted: int


def verify(logits: torch.Tensor, seqs: list["Sequence"]) -> list[Verified]:
    """Exact verification of point-mass drafts for a batch of sequences.

    logits: float32 [sum(len(s.draft) + 1), V]; sequence s owns len(s.draft) + 1 consecutive
    rows, row i scoring the token after s.draft[:i]. All tensor work is batched over rows; only
    the accept/reject walk along each draft is a Python loop over scalars."""
    device = logits.device
    num_rows = [len(s.draft) + 1 for s in seqs]
    starts = [sum(num_rows[:i]) for i in range(len(seqs))]
    params = [s.request.params for s in seqs]
    row_params = [p for p, n in zip(params, num_rows) for _ in range(n)]
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in row_params], device=device)
    logprobs_all = torch.log_softmax(logits / temperature.unsqueeze(-1), dim=-1)
    greedy_tokens = logits.argmax(dim=-1).tolist()
    probs = logprobs_all.exp()
    top_k = torch.tensor([p.top_k for p in row_params], device=device)
    top_p = torch.tensor([p.top_p for p in row_params], device=device)
    min_p = torch.tensor([p.min_p for p in row_params], device=device)
    truncating = ((top_k > 0) & (top_k < probs.shape[-1])) | (top_p < 1) | (min_p > 0)
    if truncating.any():
        rows = truncating.nonzero().squeeze(-1)
        probs[rows] = probs[rows] * truncation_mask(probs[rows], top_k[rows], top_p[rows], min_p[rows])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    # Probability the target gives each drafted token, for every row that verifies one.
    draft_rows = [start + i for seq, start in zip(seqs, starts) for i in range(len(seq.draft))]
    draft_tokens = [t for seq in seqs for t in seq.draft]
    draft_probs = probs[torch.tensor(draft_rows, dtype=torch.int64, device=device),
                        torch.tensor(draft_tokens, dtype=torch.int64, device=device)].tolist()

    accepted_counts: list[int] = []
    draws: list[tuple[int, int, float]] = []   # (row to draw from, token to exclude or -1, uniform)
    k = 0
    for seq, param, start in zip(seqs, params, starts):
        accepted = 0
        for i, token in enumerate(seq.draft):
            if param.greedy:
                ok = token == greedy_tokens[start + i]
            else:
                ok = _uniform(seq) < draft_probs[k + i]
            if not ok:
                break
            accepted += 1
        k += len(seq.draft)
        accepted_counts.append(accepted)
        row = start + accepted
        if param.greedy:
            draws.append((row, -1, -1.0))
        else:   # rejected: residual = target without the rejected draft; else a bonus draw
            excluded = seq.draft[accepted] if accepted < len(seq.draft) else -1
            draws.append((row, excluded, _uniform(seq)))

    # One batched inverse-CDF draw for every sequence's final token.
    rows = torch.tensor([r for r, _, _ in draws], dtype=torch.int64, device=device)
    weights = probs[rows].double()
    excluded = torch.tensor([e for _, e, _ in draws], dtype=torch.int64, device=device)
    has_excluded = excluded >= 0
    weights[has_excluded.nonzero().squeeze(-1), excluded[has_excluded]] = 0.0
    cdf = weights.cumsum(dim=-1)
    uniforms = torch.tensor([u for _, _, u in draws], dtype=torch.float64, device=device)
    chosen = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    chosen = torch.minimum(chosen, (cdf < cdf[:, -1:]).sum(dim=-1))   # rounding guard: last positive token
    final = chosen.tolist()

    results = []
    for seq, param, start, accepted, (row, _, _), drawn in zip(seqs, params, starts, accepted_counts, draws, final):
        last = greedy_tokens[row] if param.greedy else drawn
        tokens = seq.draft[:accepted] + [last]
        token_rows = torch.arange(start, start + len(tokens), device=device)
        logprobs = logprobs_all[token_rows, torch.tensor(tokens, device=device)].tolist()
        results.append(Verified(tokens, logprobs, accepted))
    return results


def _uniform(seq: "Sequence") -> float:
    return torch.rand((), generator=seq.generator, dtype=torch.float64).item()
