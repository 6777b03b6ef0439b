"""Groups being generated, possibly across weight updates: each sample as far as it got.

An unfinished sample keeps the tokens it has, with the engine log-prob and the weight version
that sampled each; it continues as a request of its prompt + tokens (prefilled again under the
new weights, or adopting its parked K/V). So a sample's tokens may come from several weight
versions, and the loss's importance correction (TIS / MIS) uses exactly those behaviour
log-probs. The over-sampled rollout carries such groups to the next step, the asynchronous
producer holds them open across updates; both checkpoint them (`to_state` / `from_state`).
A mixture of experts' sample keeps the routes of the tokens computed so far, and a continuation
adds the routes of those it computes (`sample_routes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from miles_like.data import Problem
from miles_like.rollouts import sample_routes
from miles_like.rollouts.replica_batcher import Generation

ABORTED = "abort"  # finish_reason of a sample the engine stopped (unfinished)


class Partial(NamedTuple):
    """One sample of an open group, as far as it got."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]  # the weight version that sampled each token
    finish_reason: str  # ABORTED while unfinished
    # of prompt + token_ids, the tokens computed so far (`sample_routes`); None: none kept
    routes: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason != ABORTED

    def extended(self, g: Generation) -> Partial:
        return Partial(
            self.token_ids + tuple(g.token_ids),
            self.logprobs + tuple(g.logprobs),
            self.versions + (g.versions or (g.weight_version,) * len(g.token_ids)),
            g.finish_reason,
            sample_routes.extend(self.routes, g.routes),
        )


class OpenGroup(NamedTuple):
    """A group being generated, possibly over several steps."""

    problem: Problem
    samples: tuple[Partial, ...]  # () until its first request returns
    rollouts: int = 0  # the rollouts it has been part of before this one
    # `partial: in_place`: the generating replica (its position among them) that parked its
    # K/V in its last rollout, where its continuation goes (`oversampling.homed_shares`)
    replica: int | None = None

    @property
    def done(self) -> bool:
        return bool(self.samples) and all(s.done for s in self.samples)

    def oldest(self) -> int | None:
        """The oldest weight version of its tokens (None: no token yet)."""
        return min((v for s in self.samples for v in s.versions), default=None)


EMPTY = Partial((), (), (), ABORTED)


def to_state(groups: Sequence[OpenGroup]) -> list[dict]:
    """JSON-ready (floats round-trip exactly through json)."""
    return [
        {
            "prompt": g.problem.prompt,
            "prompt_ids": list(g.problem.prompt_ids),
            "answer": g.problem.answer,
            "rollouts": g.rollouts,
            **({"replica": g.replica} if g.replica is not None else {}),
            "samples": [
                {
                    "token_ids": list(s.token_ids),
                    "logprobs": list(s.logprobs),
                    "versions": list(s.versions),
                    "finish_reason": s.finish_reason,
                    "routes": sample_routes.to_state(s.routes),
                }
                for s in g.samples
            ],
        }
        for g in groups
    ]


def from_state(rows: Sequence[dict]) -> list[OpenGroup]:
    return [
        OpenGroup(
            Problem(r["prompt"], list(r["prompt_ids"]), r["answer"]),
            tuple(
                Partial(
                    tuple(s["token_ids"]),
                    tuple(float(x) for x in s["logprobs"]),
                    tuple(s["versions"]),
                    s["finish_reason"],
                    sample_routes.from_state(s.get("routes")),
                )
                for s in r["samples"]
            ),
            r["rollouts"],
            r.get("replica"),
        )
        for r in rows
    ]
