"""A trajectory: one sample of a rollout, as the trainer will see it.

`token_ids` is the whole sequence, prompt first, then every turn: the tokens the engine sampled
and, between turns, the tokens the rollout function appended (a tool's result, a user message,
the chat template's markers). Per token after the prompt, `loss_mask` says which the engine
sampled (1) and which it did not (0); `logprobs` and `weight_versions` hold the engine's
log-prob and weight version of the sampled tokens (0.0 and -1 elsewhere). A single-turn sample
is a one-turn trajectory: the prompt, then the sampled tokens, mask all ones. A mixture of
experts' `routes` are the experts the engine routed each computed token to (`sample_routes`):
[tokens - 1, sparse layers, k], for the trainer to replay; None for a dense model or with
`algorithm.routing_replay: off`.

Sampled tokens are never decoded and re-encoded: a multi-turn function builds a turn's input as
the previous tokens plus the template's tokens for the new messages (`TrajectoryBuilder`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from miles_like.rollouts import sample_routes

NOT_SAMPLED = -1  # weight version of a token the engine did not sample


@dataclass(frozen=True)
class Trajectory:
    token_ids: tuple[int, ...]
    prompt_len: int
    loss_mask: tuple[int, ...]  # per token after the prompt: 1 = the engine sampled it
    logprobs: tuple[float, ...]  # the engine's, per token after the prompt; else 0.0
    weight_versions: tuple[int, ...]  # per token after the prompt; NOT_SAMPLED if unsampled
    reward: float | None = None  # None: the controller scores response_text
    response_text: str = ""  # what the reward function sees
    finish_reason: str = "stop"  # of the last turn: "stop" | "length" | "abort" | ...
    metrics: Mapping[str, float] = field(default_factory=dict)  # e.g. turns, tool_calls
    # a mixture of experts' routes per computed token (module doc); None: none kept
    routes: torch.Tensor | None = field(default=None, compare=False)

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def check(self) -> None:
        """Raise ValueError / TypeError (one line) unless the fields are consistent: a rollout
        function is user code and may return anything."""
        if not isinstance(self.prompt_len, int) or not 1 <= self.prompt_len <= len(self.token_ids):
            raise ValueError(
                f"prompt_len={self.prompt_len!r} must be an int in [1, "
                f"len(token_ids)={len(self.token_ids)}]"
            )
        if not all(isinstance(t, int) and t >= 0 for t in self.token_ids):
            raise ValueError("token_ids must be non-negative ints")
        n = self.response_len
        for name in ("loss_mask", "logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries for the {n} "
                    "tokens after the prompt; give one per token"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")
        if not any(self.loss_mask):
            raise ValueError("loss_mask has no sampled token; a trajectory needs at least one")
        for m, lp, v in zip(self.loss_mask, self.logprobs, self.weight_versions):
            if m and not (isinstance(lp, float) and math.isfinite(lp) and lp <= 0.0):
                raise ValueError(
                    f"logprobs of a sampled token is {lp!r}; give the engine's "
                    "(a finite float <= 0)"
                )
            if m and (not isinstance(v, int) or v < 0):
                raise ValueError(
                    f"weight_versions of a sampled token is {v!r}; give the "
                    "engine's weight version (an int >= 0)"
                )
            if not m and (lp != 0.0 or v != NOT_SAMPLED):
                raise ValueError(
                    f"a token outside the loss mask has logprob {lp!r} and weight "
                    f"version {v!r}; they must be 0.0 and {NOT_SAMPLED}"
                )
        if self.reward is not None and not (
            isinstance(self.reward, (int, float)) and math.isfinite(self.reward)
        ):
            raise ValueError(f"reward={self.reward!r} must be a finite number or None")
        if not isinstance(self.response_text, str):
            raise TypeError(f"response_text must be a str, not {type(self.response_text).__name__}")
        if not isinstance(self.finish_reason, str):
            raise TypeError("finish_reason must be a str")
        for k, v in self.metrics.items():
            if not isinstance(k, str) or not isinstance(v, (int, float)):
                raise TypeError(f"metrics[{k!r}]={v!r}: metrics map names to numbers")
        sample_routes.check(self.routes, len(self.token_ids), "Trajectory.routes")


class TrajectoryBuilder:
    """Assembles a multi-turn trajectory token by token, so the mask cannot drift from the
    tokens: `sampled(...)` appends what the engine returned, `appended(ids)` what the rollout
    function adds between turns (e.g. `chat.delta_ids(...)`); `token_ids` is the next turn's
    input. A mixture's routes come with each turn (`Generation.routes`): the turn computed the
    tokens appended before it too, so its routes cover them (`sample_routes`)."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.prompt_len = len(prompt_ids)
        self._tokens = [int(t) for t in prompt_ids]
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._routes: torch.Tensor | None = None
        self._routed_turns = 0
        self.finish_reason = "stop"
        self.turns = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self._tokens)

    def sampled(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        weight_version: int,
        finish_reason: str = "stop",
        versions: Sequence[int] | None = None,
        routes: torch.Tensor | None = None,
    ) -> None:
        """`versions`: the version that sampled each token where they differ (a turn that ran
        across a weight update: `Generation.versions`); else `weight_version` sampled all.
        `routes`: the turn's `Generation.routes`, for the input `token_ids` was (None: a dense
        model, or routes not kept)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} logprobs")
        if versions and len(versions) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(versions)} versions")
        self._tokens += [int(t) for t in token_ids]
        self._mask += [1] * len(token_ids)
        self._logprobs += [float(x) for x in logprobs]
        self._versions += (
            [int(v) for v in versions] if versions else [int(weight_version)] * len(token_ids)
        )
        if routes is not None:
            self._routes = sample_routes.extend(self._routes, routes, len(self._tokens))
            self._routed_turns += 1
        self.finish_reason = finish_reason
        self.turns += 1

    def appended(self, token_ids: Sequence[int]) -> None:
        self._tokens += [int(t) for t in token_ids]
        self._mask += [0] * len(token_ids)
        self._logprobs += [0.0] * len(token_ids)
        self._versions += [NOT_SAMPLED] * len(token_ids)

    def build(
        self,
        *,
        response_text: str,
        reward: float | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> Trajectory:
        """The trajectory so far; `metrics` gets `turns` unless it has its own. Routes only
        when every turn gave them (a turn without leaves rows no request computed)."""
        if self._routed_turns not in (0, self.turns):
            raise ValueError(
                f"{self._routed_turns} of {self.turns} turns gave routes; pass every turn's "
                "Generation.routes to TrajectoryBuilder.sampled"
            )
        return Trajectory(
            tuple(self._tokens),
            self.prompt_len,
            tuple(self._mask),
            tuple(self._logprobs),
            tuple(self._versions),
            reward=reward,
            response_text=response_text,
            finish_reason=self.finish_reason,
            metrics={"turns": float(self.turns), **(metrics or {})},
            routes=self._routes,
        )


def single_turn(
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    weight_version: int,
    finish_reason: str,
    response_text: str,
    routes: torch.Tensor | None = None,
) -> Trajectory:
    """A one-turn trajectory: the prompt, then the sampled tokens (`routes`: the sample's
    `Generation.routes`)."""
    b = TrajectoryBuilder(prompt_ids)
    b.sampled(token_ids, logprobs, weight_version, finish_reason, routes=routes)
    return b.build(response_text=response_text)
