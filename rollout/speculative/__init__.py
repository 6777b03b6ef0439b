"""Speculative decoding: proposers guess the next tokens of a sequence, the target model scores
the pending token plus k drafted ones in one forward pass, and `verify` accepts a prefix of the
draft so that the emitted tokens are distributed exactly as if sampled one by one from the target.

* `lookup.py`: the `ngram` and `group` proposers (drafts read from text already seen);
* `draft_model.py`: the `draft` proposer (a smaller model with the target's vocabulary);
* `verify.py`: exact verification (rejection sampling against the target's distribution);
* `drafting.py`: the scheduler's side (how many tokens each sequence drafts, the per-sequence
  back-off, the bookkeeping after a verify pass).

The package's own modules import each other directly (`rollout.speculative.verify`, ...), never
through this file, which re-exports the public names for users of the package.
"""

from rollout.speculative.drafting import (
    NO_DRAFT,
    Draft,
    DraftBackoff,
    Drafting,
    DraftProposer,
    Speculation,
)
from rollout.speculative.lookup import PROPOSERS, Proposer, SuffixIndex
from rollout.speculative.verify import Verified, sampling_distribution, verify

__all__ = [
    "NO_DRAFT",
    "PROPOSERS",
    "Draft",
    "DraftBackoff",
    "DraftProposer",
    "Drafting",
    "Proposer",
    "Speculation",
    "SuffixIndex",
    "Verified",
    "sampling_distribution",
    "verify",
]
