"""Scoring a rollout's groups: the reward of every trajectory, then DAPO's overlong penalty.

A trajectory's own reward (set by its rollout function) stands; the others are scored by the
recipe's reward function on their `response_text`, in the reward worker pool with
`reward.timeout_s` (a failure, junk or a timeout scores 0 and is counted). `rewards` is what
the advantages see: scores + shaping. The same function scores a whole step at its end, a
single-turn group as soon as its samples are done (streaming), and a finished agent group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from miles_like.data import Problem
from miles_like.rollouts.partial import OpenGroup
from miles_like.rollouts.trajectory import Trajectory
from miles_like.scoring.rewards import RewardFn, compute_rewards
from miles_like.scoring.shaping import informative_groups, overlong_penalty


class Group(NamedTuple):
    problem: Problem
    trajectories: list[Trajectory]  # the n trajectories of this prompt
    scores: list[float]  # the reward function's scores (or the trajectories' own rewards)
    rewards: list[float]  # what the advantages see: scores + shaping


@dataclasses.dataclass(frozen=True)
class GroupScorer:
    """Scores groups with the recipe's reward function and shaping."""

    recipe: Any  # the run's Recipe
    reward_fn: RewardFn
    tokenizer: Any = None  # transformers tokenizer: decodes an open group's samples

    def groups(
        self, problems: list[Problem], trajectories: list[list[Trajectory]]
    ) -> tuple[list[Group], dict]:
        """Groups with scores and shaped rewards, and the reward function's failure counts."""
        r = self.recipe
        unscored = [
            (p, t) for p, group in zip(problems, trajectories) for t in group if t.reward is None
        ]
        result = compute_rewards(
            self.reward_fn,
            [p.prompt for p, _ in unscored],
            [t.response_text for _, t in unscored],
            [p.answer for p, _ in unscored],
            max_workers=r.reward.max_workers,
            timeout_s=r.reward.timeout_s,
        )
        computed = iter(result.scores)
        flat = [
            t.reward if t.reward is not None else next(computed)
            for group in trajectories
            for t in group
        ]
        lengths = torch.tensor([t.sampled_tokens for g in trajectories for t in g])
        penalty = overlong_penalty(
            lengths,
            r.rollout.max_new_tokens,
            r.algorithm.overlong_buffer,
            r.algorithm.overlong_penalty,
        )
        groups, k, n = [], 0, r.rollout.n
        for p, group in zip(problems, trajectories):
            scores = flat[k : k + n]
            rewards = [s + float(penalty[k + j]) for j, s in enumerate(scores)]
            groups.append(Group(p, group, scores, rewards))
            k += n
        return groups, {
            "reward_errors": result.num_errors,
            "reward_nan": result.num_nan,
            "reward_timeouts": result.num_timeouts,
        }

    def open_group(self, group: OpenGroup) -> tuple[Group, dict]:
        """A complete single-turn open group: its samples as one-turn trajectories (text decoded
        without special tokens), scored as `groups` scores them."""
        p = group.problem
        trajectories = [
            Trajectory(
                tuple(p.prompt_ids) + s.token_ids,
                len(p.prompt_ids),
                (1,) * len(s.token_ids),
                s.logprobs,
                s.versions,
                response_text=self.tokenizer.decode(list(s.token_ids), skip_special_tokens=True),
                finish_reason=s.finish_reason,
                metrics={"turns": 1.0},
                routes=s.routes,
            )
            for s in group.samples
        ]
        (scored,), counts = self.groups([p], [trajectories])
        return scored, counts

    def finished(
        self, problem: Problem, trajectories: list[Trajectory], tallies: dict
    ) -> tuple[Group, dict]:
        """A finished agent group, with its function's own `ctx.reward` failure counts added."""
        (group,), counts = self.groups([problem], [trajectories])
        for k, v in tallies.items():
            counts[k] = counts.get(k, 0) + v
        return group, counts


def informative(groups: list[Group]) -> list[Group]:
    """The groups whose rewards are not all equal (dynamic sampling keeps those)."""
    if not groups:
        return []
    mask = informative_groups(torch.tensor([g.rewards for g in groups]))
    return [g for g, keep in zip(groups, mask.tolist()) if keep]
