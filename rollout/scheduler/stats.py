"""The scheduler's counters (`Engine.stats()` reports them by these names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    prefill_tokens_computed: int = 0
    prefix_cache_hit_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    evicted_tokens: int = 0
    spec_verify_steps: int = 0  # sequence-steps that verified a non-empty draft
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_backoff_steps: int = 0  # sequence-steps that skipped drafting after failed drafts
    finished_samples: int = 0  # samples that ended by a stop or the length limit (not aborts)
    parked_reused_tokens: int = 0  # tokens of parked K/V a continuation adopted
    parked_dropped_tokens: int = 0  # tokens of parked K/V dropped (memory, flush, release)
    # tokens of running sequences whose K/V a weight update kept (`keep_running`): not
    # prefilled again under the new weights
    in_place_kept_tokens: int = 0
