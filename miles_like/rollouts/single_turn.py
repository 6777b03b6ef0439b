"""The built-in rollout function (`rollout.function: single_turn`): one request of n samples
per prompt, each sample a one-turn trajectory that the controller scores with the recipe's
reward on its decoded text (special tokens removed)."""

from __future__ import annotations

from miles_like.data import Problem
from miles_like.rollouts import trajectory
from miles_like.rollouts.context import RolloutContext


async def single_turn(ctx: RolloutContext, problem: Problem) -> list[trajectory.Trajectory]:
    samples = await ctx.generate_group(problem.prompt_ids)
    return [
        trajectory.single_turn(
            problem.prompt_ids,
            s.token_ids,
            s.logprobs,
            s.weight_version,
            s.finish_reason,
            ctx.tokenizer.decode(s.token_ids, skip_special_tokens=True),
            s.routes,
        )
        for s in samples
    ]
