"""One step's rollout: draw prompts, generate their groups on the engine replicas, score them,
shape the rewards (DAPO's overlong penalty) and, with dynamic sampling, drop groups whose
rewards are all equal and draw more prompts until the batch is full again.

Prompts are split into contiguous shares, one per engine replica, generated concurrently. Every
prompt gets its own sampling seed, drawn from (run seed, step, round), so a step's samples do
not depend on how prompts were split over engines, and a resumed run samples the same tokens.
For the same reason an engine that dies mid-rollout loses nothing: its share is generated again,
with the same seeds, on its replacement (`rollout/engine_restarts` counts them).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from miles_like.build_configs import sampling_params
from miles_like.calls import ActorDied, Call, call, gather
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
    params: list             # SamplingParams per problem (its seed included)
    calls: list[Call]        # engine i generates share i
    shares: list[range]
    started: float
    consumed_before: int     # the prompt source's position before this rollout drew its prompts


def _split(n: int, parts: int) -> list[range]:
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(range(start, end))
        start = end
    return out


class RolloutManager:
    """`engines` is used as given (not copied): the owner replaces a dead engine in it.
    `restart_engine(i)` replaces engine i and returns the new one; without it an engine's death
    raises `calls.ActorDied`."""

    def __init__(self, recipe, engines: list, tokenizer, reward_fn, source: PromptSource,
                 restart_engine: Callable[[int], object] | None = None, log=print):
        self.recipe = recipe
        self.engines = engines
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.source = source
        self.restart_engine = restart_engine
        self.log = log

    # ------------------------------------------------------------------------------ generation
    def _params(self, step: int, round_: int, k: int) -> list:
        rng = random.Random(f"{self.recipe.seed}/{step}/{round_}")
        return [sampling_params(self.recipe, seed=rng.getrandbits(62)) for _ in range(k)]

    def launch(self, step: int, problems: list[Problem] | None = None,
               round_: int = 0) -> PendingRollout:
        """Start generating (non-blocking) for `problems`, default the next batch of prompts."""
        consumed_before = self.source.consumed
        if problems is None:
            problems = self.source.next_batch(self.recipe.rollout.prompts_per_step)
        params = self._params(step, round_, len(problems))
        # empty shares (fewer prompts than engines) are the last ones: share i is engine i's
        shares = [s for s in _split(len(problems), len(self.engines)) if len(s)]
        calls = [self._generate(i, problems, params, share) for i, share in enumerate(shares)]
        return PendingRollout(step, problems, params, calls, shares, time.perf_counter(),
                              consumed_before)

    def _generate(self, i: int, problems: list[Problem], params: list, share: range) -> Call:
        return call(f"engine {i}", self.engines[i], "generate",
                    [problems[j].prompt_ids for j in share], [params[j] for j in share])

    def _collect(self, pending: PendingRollout) -> tuple[list[Group], Counter]:
        """Wait for `pending` and score it: its groups, and its tallies (reward errors / NaN,
        generated tokens, prefill tokens computed and taken from the prefix cache, engine
        restarts). A share whose engine died is generated again, with the same seeds, on the
        engine's replacement."""
        samples: list[list] = [None] * len(pending.problems)  # type: ignore[list-item]
        tallies: Counter = Counter()

        def regenerate(i: int, died: ActorDied) -> Call:
            if self.restart_engine is None:
                raise died
            self.log(f"{died}; restarting it and generating its {len(pending.shares[i])} "
                     "prompts again")
            self.restart_engine(i)
            tallies["engine_restarts"] += 1
            return self._generate(i, pending.problems, pending.params, pending.shares[i])

        results = gather(pending.calls, self.recipe.cluster.call_timeout_s, on_death=regenerate)
        for share, (outs, cache) in zip(pending.shares, results):
            tallies.update(cache)
            for i, group in zip(share, outs):
                samples[i] = group
        groups, scored = self._score(pending.problems, samples)
        tallies.update(scored)
        tallies["generated_tokens"] += sum(len(s.token_ids) for g in samples for s in g)
        return groups, tallies

    # --------------------------------------------------------------------------------- scoring
    def _score(self, problems: list[Problem], samples: list[list]) -> tuple[list[Group], dict]:
        """Groups with scores and shaped rewards, and the reward function's failure counts."""
        r = self.recipe
        prompts, responses, answers = [], [], []
        for p, group in zip(problems, samples):
            for s in group:
                prompts.append(p.prompt)
                responses.append(self.tokenizer.decode(s.token_ids, skip_special_tokens=True))
                answers.append(p.answer)
        result = compute_rewards(self.reward_fn, prompts, responses, answers,
                                 max_workers=r.reward.max_workers,
                                 timeout_s=r.reward.timeout_s)
        lengths = torch.tensor([len(s.token_ids) for g in samples for s in g])
        penalty = overlong_penalty(lengths, r.rollout.max_new_tokens,
                                   r.algorithm.overlong_buffer, r.algorithm.overlong_penalty)
        groups, k, n = [], 0, r.rollout.n
        for p, group in zip(problems, samples):
            scores = result.scores[k:k + n]
            rewards = [s + float(penalty[k + j]) for j, s in enumerate(scores)]
            groups.append(Group(p, group, scores, rewards))
            k += n
        return groups, {"reward_errors": result.num_errors, "reward_nan": result.num_nan,
                        "reward_timeouts": result.num_timeouts}

    # ---------------------------------------------------------------------------------- finish
    def finish(self, pending: PendingRollout) -> Rollout:
        """Wait for `pending`, score it, and (dynamic sampling) refill dropped groups."""
        r = self.recipe
        generated, tallies = self._collect(pending)
        kept, rounds = generated, 1
        if r.algorithm.dynamic_sampling:
            kept = self._informative(generated)
            tallies["dropped_groups"] += len(generated) - len(kept)
            while (len(kept) < r.rollout.prompts_per_step
                   and rounds <= r.algorithm.dynamic_sampling_max_rounds):
                more = self.launch(pending.step, self.source.next_batch(
                    r.rollout.prompts_per_step - len(kept)), round_=rounds)
                extra, t = self._collect(more)
                tallies.update(t)
                informative = self._informative(extra)
                tallies["dropped_groups"] += len(extra) - len(informative)
                generated, kept = generated + extra, kept + informative
                rounds += 1
            # nothing informative after every round: train on what there is (zero advantages)
            kept = kept[:r.rollout.prompts_per_step] or generated[:r.rollout.prompts_per_step]
        seconds = time.perf_counter() - pending.started
        metrics = self._metrics(generated)
        hits, computed = tallies["prefix_cache_hit_tokens"], tallies["prefill_tokens_computed"]
        metrics.update(reward_errors=tallies["reward_errors"], reward_nan=tallies["reward_nan"],
                       reward_timeouts=tallies["reward_timeouts"],
                       generated_tokens=tallies["generated_tokens"],
                       tokens_per_s=tallies["generated_tokens"] / max(seconds, 1e-9),
                       prefix_cache_hit_rate=hits / max(hits + computed, 1),
                       samples=sum(len(g.samples) for g in kept),
                       engine_restarts=tallies["engine_restarts"])
        if r.algorithm.dynamic_sampling:
            metrics.update(dynamic_rounds=rounds, dynamic_dropped_groups=tallies["dropped_groups"],
                           dynamic_kept_groups=len(kept))
        return Rollout(kept, metrics)

    @staticmethod
    def _informative(groups: list[Group]) -> list[Group]:
        if not groups:
            return []
        mask = informative_groups(torch.tensor([g.rewards for g in groups]))
        return [g for g, keep in zip(groups, mask.tolist()) if keep]

    @staticmethod
    def _metrics(groups: list[Group]) -> dict:
        """Reward and length metrics over every generated group of the step (kept or dropped)."""
        scores = torch.tensor([g.scores for g in groups], dtype=torch.float64)
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
        lengths = torch.tensor([[len(s.token_ids) for s in g.samples] for g in groups],
                               dtype=torch.float64)
        truncated = sum(s.finish_reason == "length" for g in groups for s in g.samples)
        return {
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std(unbiased=False)),
            "reward_group_std_mean": float(scores.std(dim=1, unbiased=False).mean()),
            "shaped_reward_mean": float(rewards.mean()),
            "response_len_mean": float(lengths.mean()),
            "response_len_max": float(lengths.max()),
            "truncated_frac": truncated / lengths.numel(),
        }
