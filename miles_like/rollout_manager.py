"""One step's rollout: draw prompts, generate their groups on the engine replicas, score them,
shape the rewards (DAPO's overlong penalty) and, with dynamic sampling, drop groups whose
rewards are all equal and draw more prompts until the batch is full again.

Prompts are split into contiguous shares, one per engine replica, generated concurrently. Every
prompt gets its own sampling seed, drawn from (run seed, step, round), so a step's samples do
not depend on how prompts were split over engines, and a resumed run samples the same tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import NamedTuple

import ray
import torch

from miles_like.build_configs import sampling_params
from miles_like.data import Problem, PromptSource
from miles_like.reward_shaping import informative_groups, overlong_penalty
from miles_like.rewards import compute_rewards


class Group(NamedTuple):
    problem: Problem
    samples: list            # rollout.SampleOutput, the n samples of this prompt
    scores: list[float]      # the reward function's scores
    rewards: list[float]     # what the advantages see: scores + shaping


class Rollout(NamedTuple):
    groups: list[Group]
    metrics: dict[str, float]


class PendingRollout(NamedTuple):
    step: int
    problems: list[Problem]
    refs: list               # one ObjectRef per engine share
    shares: list[range]
    started: float
    stats_before: list[dict]


def _split(n: int, parts: int) -> list[range]:
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(range(start, end))
        start = end
    return out


class RolloutManager:
    def __init__(self, recipe, engines: Sequence, tokenizer, reward_fn, source: PromptSource):
        self.recipe = recipe
        self.engines = list(engines)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.source = source

    # ------------------------------------------------------------------------------ generation
    def _params(self, step: int, round_: int, k: int) -> list:
        rng = random.Random(f"{self.recipe.seed}/{step}/{round_}")
        return [sampling_params(self.recipe, seed=rng.getrandbits(62)) for _ in range(k)]

    def launch(self, step: int, problems: list[Problem] | None = None,
               round_: int = 0) -> PendingRollout:
        """Start generating (non-blocking) for `problems`, default the next batch of prompts."""
        if problems is None:
            problems = self.source.next_batch(self.recipe.rollout.prompts_per_step)
        params = self._params(step, round_, len(problems))
        stats = ray.get([e.stats.remote() for e in self.engines])
        shares = [s for s in _split(len(problems), len(self.engines))]
        refs = [e.generate.remote([problems[i].prompt_ids for i in share],
                                  [params[i] for i in share])
                for e, share in zip(self.engines, shares) if len(share)]
        return PendingRollout(step, problems, refs, [s for s in shares if len(s)],
                              time.perf_counter(), stats)

    def _samples(self, pending: PendingRollout) -> list[list]:
        out: list[list] = [None] * len(pending.problems)  # type: ignore[list-item]
        for share, (outs, _) in zip(pending.shares, ray.get(pending.refs)):
            for i, samples in zip(share, outs):
                out[i] = samples
        return out

    # --------------------------------------------------------------------------------- scoring
    def _score(self, problems: list[Problem], samples: list[list]) -> tuple[list[Group], dict]:
        r = self.recipe
        prompts, responses, answers = [], [], []
        for p, group in zip(problems, samples):
            for s in group:
                prompts.append(p.prompt)
                responses.append(self.tokenizer.decode(s.token_ids, skip_special_tokens=True))
                answers.append(p.answer)
        result = compute_rewards(self.reward_fn, prompts, responses, answers,
                                 max_workers=r.reward.max_workers)
        lengths = torch.tensor([len(s.token_ids) for g in samples for s in g])
        penalty = overlong_penalty(lengths, r.rollout.max_new_tokens,
                                   r.algorithm.overlong_buffer, r.algorithm.overlong_penalty)
        groups, k, n = [], 0, r.rollout.n
        for p, group in zip(problems, samples):
            scores = result.scores[k:k + n]
            rewards = [s + float(penalty[k + j]) for j, s in enumerate(scores)]
            groups.append(Group(p, group, scores, rewards))
            k += n
        return groups, {"reward_errors": result.num_errors, "reward_nan": result.num_nan}

    # ---------------------------------------------------------------------------------- finish
    def finish(self, pending: PendingRollout) -> Rollout:
        """Wait for `pending`, score it, and (dynamic sampling) refill dropped groups."""
        r = self.recipe
        groups, counts = self._score(pending.problems, self._samples(pending))
        generated = sum(len(s.token_ids) for g in groups for s in g.samples)
        rounds, dropped = 1, 0
        if r.algorithm.dynamic_sampling:
            all_groups = groups
            keep = self._informative(groups)
            dropped = len(groups) - len(keep)
            while len(keep) < r.rollout.prompts_per_step and \
                    rounds <= r.algorithm.dynamic_sampling_max_rounds:
                missing = r.rollout.prompts_per_step - len(keep)
                more = self.launch(pending.step, self.source.next_batch(missing), round_=rounds)
                extra, c = self._score(more.problems, self._samples(more))
                for key in counts:
                    counts[key] += c[key]
                all_groups = all_groups + extra
                generated += sum(len(s.token_ids) for g in extra for s in g.samples)
                kept_extra = self._informative(extra)
                dropped += len(extra) - len(kept_extra)
                keep += kept_extra
                rounds += 1
            groups_for_metrics = all_groups
            groups = keep[:r.rollout.prompts_per_step] or all_groups[:r.rollout.prompts_per_step]
        else:
            groups_for_metrics = groups
        seconds = time.perf_counter() - pending.started
        stats_after = ray.get([e.stats.remote() for e in self.engines])
        metrics = self._metrics(groups_for_metrics, pending.stats_before, stats_after)
        metrics.update(counts)
        metrics.update(tokens_per_s=generated / max(seconds, 1e-9), generated_tokens=generated,
                       samples=sum(len(g.samples) for g in groups))
        if r.algorithm.dynamic_sampling:
            metrics.update(dynamic_rounds=rounds, dynamic_dropped_groups=dropped,
                           dynamic_kept_groups=len(groups))
        return Rollout(groups, metrics)

    @staticmethod
    def _informative(groups: list[Group]) -> list[Group]:
        if not groups:
            return []
        mask = informative_groups(torch.tensor([g.rewards for g in groups]))
        return [g for g, keep in zip(groups, mask.tolist()) if keep]

    def _metrics(self, groups: list[Group], before: list[dict], after: list[dict]) -> dict:
        """Metrics over every generated group of the step (kept or dropped)."""
        scores = torch.tensor([g.scores for g in groups], dtype=torch.float64)
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
        lengths = torch.tensor([[len(s.token_ids) for s in g.samples] for g in groups],
                               dtype=torch.float64)
        truncated = sum(s.finish_reason == "length" for g in groups for s in g.samples)
        computed = sum(a["prefill_tokens_computed"] - b["prefill_tokens_computed"]
                       for a, b in zip(after, before))
        hits = sum(a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"]
                   for a, b in zip(after, before))
        return {
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std(unbiased=False)),
            "reward_group_std_mean": float(scores.std(dim=1, unbiased=False).mean()),
            "shaped_reward_mean": float(rewards.mean()),
            "response_len_mean": float(lengths.mean()),
            "response_len_max": float(lengths.max()),
            "truncated_frac": truncated / lengths.numel(),
            "prefix_cache_hit_rate": hits / max(hits + computed, 1),
        }
