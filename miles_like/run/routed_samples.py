"""What an engine replica returns per sample to the controller: a `rollout.SampleOutput` and,
when routing replay is on, the mixture of experts' routes of its computed tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RoutedSample(NamedTuple):
    """A `rollout.SampleOutput` and, with `return_routes`, its routes
    (`RequestOutput.routed_experts`: a mixture of experts'; else None)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list | None
    routes: torch.Tensor | None


def routed_samples(result, return_routes: bool) -> list[RoutedSample]:
    """A `GenerationResult`'s samples, each with its routes where they are returned."""
    routes = result.routed_experts if return_routes else None
    return [
        RoutedSample(*s, routes=None if routes is None else routes[j])
        for j, s in enumerate(result.samples)
    ]
