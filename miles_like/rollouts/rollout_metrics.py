"""The rollout/ metrics of a step: the groups' own (rewards, lengths, turns, trajectory
metrics) and the engines' (tokens, throughput, prefix-cache hit rates, restarts)."""

from __future__ import annotations

from collections import Counter

import torch

from miles_like.rollouts.group_scoring import Group

# trajectory metrics summed over the step (counts); every other one is averaged
COUNT_METRICS = ("tool_errors", "retokenize_mismatch")


def group_metrics(groups: list[Group]) -> dict:
    """Reward, length and turn metrics over every generated group of the step (kept or
    dropped). Trajectory metrics: COUNT_METRICS are summed, the others averaged (`_mean`);
    turns, tool calls and the counts are always there (a single turn: 1, 0, 0)."""
    scores = torch.tensor([g.scores for g in groups], dtype=torch.float64)
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    trajectories = [t for g in groups for t in g.trajectories]
    lengths = torch.tensor(
        [[t.response_len for t in g.trajectories] for g in groups], dtype=torch.float64
    )
    truncated = sum(t.finish_reason == "length" for t in trajectories)
    out = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std(unbiased=False)),
        "reward_group_std_mean": float(scores.std(dim=1, unbiased=False).mean()),
        "shaped_reward_mean": float(rewards.mean()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "truncated_frac": truncated / lengths.numel(),
        "loss_mask_frac": sum(t.sampled_tokens for t in trajectories) / float(lengths.sum()),
        "turns_mean": 1.0,
        "tool_calls_mean": 0.0,
        **{k: 0.0 for k in COUNT_METRICS},
    }
    for key in sorted({k for t in trajectories for k in t.metrics}):
        values = [float(t.metrics.get(key, 0.0)) for t in trajectories]
        if key.startswith(COUNT_METRICS):
            out[key] = sum(values)
        else:
            out[f"{key}_mean"] = sum(values) / len(values)
    return out


def step_metrics(
    generated: list[Group],
    kept: list[Group],
    tallies: Counter,
    seconds: float,
    dynamic_rounds: int | None,
) -> dict:
    """A synchronous step's: the groups' own over every generated group, the rollout's engine
    tallies over its `seconds`; `dynamic_rounds` (dynamic sampling) adds its keys."""
    metrics = group_metrics(generated)
    hits, computed = tallies["prefix_cache_hit_tokens"], tallies["prefill_tokens_computed"]
    later_hits = tallies["prefix_cache_hit_tokens_turn2plus"]
    later_computed = tallies["prefill_tokens_computed_turn2plus"]
    metrics.update(
        reward_errors=tallies["reward_errors"],
        reward_nan=tallies["reward_nan"],
        reward_timeouts=tallies["reward_timeouts"],
        generated_tokens=tallies["generated_tokens"],
        tokens_per_s=tallies["generated_tokens"] / max(seconds, 1e-9),
        prefix_cache_hit_rate=hits / max(hits + computed, 1),
        prefix_cache_hit_rate_turn2plus=later_hits / max(later_hits + later_computed, 1),
        samples=sum(len(g.trajectories) for g in kept),
        engine_restarts=tallies["engine_restarts"],
    )
    if tallies["pd_requests"] or tallies["pd_local_prefills"]:
        # prefill-decode: the later turns prefilled on their own decode replica
        # (`rollout.pd_local_prefill_tokens`), not through a prefill replica
        metrics.update(pd_local_prefills=tallies["pd_local_prefills"])
    if tallies["pd_requests"]:  # prefill-decode: the handoffs' transfer, per request
        metrics.update(
            pd_transfer_bytes=tallies["pd_transfer_bytes"] / tallies["pd_requests"],
            pd_transfer_s=tallies["pd_transfer_s"] / tallies["pd_requests"],
        )
    if dynamic_rounds is not None:
        metrics.update(
            dynamic_rounds=dynamic_rounds,
            dynamic_dropped_groups=tallies["dropped_groups"],
            dynamic_kept_groups=len(kept),
        )
    return metrics


def async_batch_metrics(
    groups: list[Group], tallies: Counter, engine: Counter, seconds: float, in_place: bool
) -> dict:
    """A fully asynchronous batch's, the keys of `step_metrics`: the groups' own over the
    batch, the engines' counters over the window since the previous batch (`engine`, over
    `seconds`: what the engines did meanwhile, for any group; prefill-decode adds the handoffs'
    transfers)."""
    metrics = group_metrics(groups)
    hits, computed = engine["prefix_cache_hit_tokens"], engine["prefill_tokens_computed"]
    metrics.update(
        reward_errors=tallies["reward_errors"],
        reward_nan=tallies["reward_nan"],
        reward_timeouts=tallies["reward_timeouts"],
        generated_tokens=engine["generated_tokens"],
        tokens_per_s=engine["generated_tokens"] / max(seconds, 1e-9),
        prefix_cache_hit_rate=hits / max(hits + computed, 1),
        prefix_cache_hit_rate_turn2plus=0.0,
        samples=sum(len(g.trajectories) for g in groups),
        engine_restarts=0,
    )
    if engine["pd_requests"]:  # prefill-decode: the handoffs' transfer, per request
        # every prompt goes through a prefill replica (single-turn): none prefilled locally
        metrics.update(pd_local_prefills=engine["pd_local_prefills"])
        metrics.update(
            pd_transfer_bytes=engine["pd_transfer_bytes"] / engine["pd_requests"],
            pd_transfer_s=engine["pd_transfer_s"] / engine["pd_requests"],
        )
    if in_place:  # K/V not computed again after an update
        metrics["in_place_reused_tokens"] = float(
            engine["parked_reused_tokens"] + engine["in_place_kept_tokens"]
        )
    return metrics


def batch_metrics(taken, stale: list[int], aborted: list[int], capacity: int) -> dict:
    """The async-only rollout/ keys of a step: `taken` (`async_producer.AsyncBatch`), the
    stale and aborted indices dropped since the previous step, the buffer's capacity."""
    n = max(len(taken.staleness), 1)
    return {
        "staleness_mean": sum(taken.staleness) / n,
        "staleness_max": float(max(taken.staleness, default=0)),
        "continued_groups": float(taken.continued),
        "stale_dropped_groups": float(len(stale)),
        "aborted_groups": float(len(aborted)),
        "buffer_groups": float(taken.buffered),
        "buffer_fill": taken.buffered / capacity,
        "trained_prompt_ids": list(taken.indices),
        "stale_dropped_prompt_ids": stale,
        "aborted_prompt_ids": aborted,
        **(
            {}
            if taken.filtered is None
            else {  # the synchronous loop's dynamic-sampling keys, and the filtered indices
                "dynamic_dropped_groups": float(len(taken.filtered)),
                "dynamic_kept_groups": float(len(taken.indices)),
                "dynamic_filtered_prompt_ids": list(taken.filtered),
            }
        ),
    }
