"""The rollout-function API: what `rollout.function` names, and the context it gets.

    async def fn(ctx: RolloutContext, problem: Problem) -> list[Trajectory]

turns one prompt into its group of `ctx.n` trajectories (`trajectory.py`). The controller runs
the functions of every prompt of a step concurrently on one asyncio loop, so their requests
are batched per replica (`replica_batcher.py`) and by the engines' step loops. Built-ins:
`single_turn` (the default: one request of n samples per prompt). A user function is
`module:function`, importable from the run's working directory or PYTHONPATH (`functions.py`).

Seeds: the controller draws one base seed per prompt from (run seed, step, round), so a run and
its resume sample the same tokens whatever the replicas' split. `ctx.sampling(j, turn)` is
sample j's parameters with seed `base + turn * n + j`: turn 0 is what the single-turn rollout
always used (the engine seeds sample j of an n-sample request with `base + j`).

A group is a session: all of its requests go to the group's replica (its samples share the
prompt's KV, its later turns extend earlier ones), groups spread over the replicas in contiguous
shares as the single-turn rollout always did, so placement does not depend on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from miles_like.data import Problem
from miles_like.rollouts.replica_batcher import Generation
from miles_like.rollouts.trajectory import Trajectory
from miles_like.scoring.rewards import DEFAULT_TIMEOUT_S, RewardFn, compute_rewards

__all__ = ["Generation", "RolloutContext", "RolloutFn"]

RolloutFn = Callable[["RolloutContext", Problem], Awaitable[list[Trajectory]]]


class EngineRequests(Protocol):
    """Where a context's engine requests go: `ReplicaBatcher` in the synchronous loop,
    `AgentCalls` in fully asynchronous training."""

    async def generate(
        self, replica: int, prompt_ids: Sequence[int], params, later_turn: bool
    ) -> list[Generation]: ...


class RolloutContext:
    """One group's view of the rollout: its sampling parameters, the engines, the tokenizer,
    the recipe's tools and turn limit, the reward. Made by the controller."""

    def __init__(
        self,
        *,
        problem: Problem,
        params,
        dispatch: EngineRequests,
        replica: int,
        tokenizer,
        context_len: int,
        vocab_size: int,
        reward_fn: RewardFn,
        reward_timeout_s: float = DEFAULT_TIMEOUT_S,
        reward_workers: int = 1,
        tools: Sequence[str] = (),
        max_turns: int = 1,
        base_url: str | None = None,
        tool_pool=None,
        settings=None,
    ):
        self.problem = problem
        self._params = params  # the group's SamplingParams (n, base seed)
        self._dispatch = dispatch
        self.replica = replica
        self.tokenizer = tokenizer
        self.context_len = context_len  # longest sequence: prompt + every turn
        self.vocab_size = vocab_size
        self._reward_fn = reward_fn
        self._reward_timeout_s = reward_timeout_s
        self._reward_workers = reward_workers  # the recipe's: the pool is shared, not resized
        self.tools = tuple(tools)  # the recipe's rollout.tools (module:function)
        self.max_turns = max_turns
        self.base_url = base_url  # OpenAI-compatible URL for external agent code
        self.tool_pool = tool_pool  # tools.ToolPool running rollout.tools, or None
        self.settings = settings  # the recipe's rollout section (budgets, tools)
        self.tallies: Counter = Counter()  # reward_errors / _nan / _timeouts of ctx.reward

    @property
    def n(self) -> int:
        return self._params.n

    def sampling(self, j: int, turn: int = 0):
        """Sample j's SamplingParams (n = 1) for its turn `turn` (0-based)."""
        if not (isinstance(j, int) and 0 <= j < self.n) or not (
            isinstance(turn, int) and turn >= 0
        ):
            raise ValueError(f"ctx.sampling(j={j!r}, turn={turn!r}): j in [0, {self.n}), turn >= 0")
        return dataclasses.replace(self._params, n=1, seed=self._params.seed + turn * self.n + j)

    def render(self, messages: Sequence[Mapping[str, Any]], tools=None) -> list[int]:
        """The chat template's tokens for `messages`, ending with the generation prompt."""
        from rollout.chat import render_ids

        return list(
            render_ids(self.tokenizer, list(messages), tools=tools, add_generation_prompt=True)
        )

    def room(self, token_ids: Sequence[int]) -> int:
        """Tokens a turn continuing `token_ids` may still sample (0: the context is full)."""
        return max(0, self.context_len - len(token_ids))

    async def generate(
        self, inputs: Sequence[int] | Sequence[Mapping[str, Any]], sampling, tools=None
    ) -> Generation:
        """One sample continuing `inputs` (token ids, or chat messages rendered by the
        template). `sampling.max_new_tokens` is lowered to the room the context leaves."""
        if sampling.n != 1:
            raise ValueError(
                f"ctx.generate takes n=1 sampling (got n={sampling.n}); use "
                "ctx.sampling(j) or ctx.generate_group"
            )
        (out,) = await self._generate(inputs, sampling, tools)
        return out

    async def generate_group(
        self, inputs: Sequence[int] | Sequence[Mapping[str, Any]], tools=None
    ) -> list[Generation]:
        """The group's n samples of `inputs` in one request (the prompt prefilled once): sample
        j equals `generate(inputs, ctx.sampling(j))`."""
        return await self._generate(inputs, self._params, tools)

    async def _generate(self, inputs, params, tools) -> list[Generation]:
        ids = self._token_ids(inputs, tools)
        room = self.room(ids)
        if room < 1:
            raise ValueError(
                f"ctx.generate: {len(ids)} tokens fill the context of "
                f"{self.context_len}; check ctx.room(token_ids) before a turn"
            )
        if params.max_new_tokens > room:
            params = dataclasses.replace(params, max_new_tokens=room)
        later = ids != list(self.problem.prompt_ids)
        return await self._dispatch.generate(self.replica, ids, params, later)

    def _token_ids(self, inputs, tools) -> list[int]:
        if len(inputs) and isinstance(inputs[0], Mapping):
            return self.render(inputs, tools)
        ids = list(inputs)
        if not ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(
                "ctx.generate: give chat messages or a non-empty list of token ids "
                f"in [0, {self.vocab_size})"
            )
        return ids

    async def reward(self, problem: Problem, text: str) -> float:
        """The recipe's reward of `text` for `problem`, scored in the reward worker pool with
        `reward.timeout_s` like the controller's own scoring: a failure, junk or a timeout
        scores 0 and is counted (rollout/reward_errors, _nan, _timeouts)."""
        result = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: compute_rewards(
                self._reward_fn,
                [problem.prompt],
                [text],
                [problem.answer],
                max_workers=self._reward_workers,
                timeout_s=self._reward_timeout_s,
            ),
        )
        self.tallies.update(
            reward_errors=result.num_errors,
            reward_nan=result.num_nan,
            reward_timeouts=result.num_timeouts,
        )
        return result.scores[0]
