"""What an engine replica returns per sample to the controller: a `rollout.SampleOutput` and,
when routing replay is on, the mixture of experts' routes of its computed tokens."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
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


def finished_requests(
    futures: list[concurrent.futures.Future],
    read: Callable[[Callable], object],
    return_routes: bool,
    passed_over: type[BaseException] | tuple[()] = (),
) -> Iterator[tuple[int, list[RoutedSample], int, list[int]]]:
    """`(index, samples, weight version, per-sample token versions)` of each of `futures` (a
    batch's `GenerationResult`s) as it finishes, the shape every streaming engine call yields.
    `read(f.result)` reads a result (a TP replica's `EngineFollowers.intact`); a request whose
    result raises `passed_over` yields nothing (the caller counts what is missing)."""
    index = {id(f): i for i, f in enumerate(futures)}
    for f in concurrent.futures.as_completed(futures):
        try:
            result = read(f.result)
        except passed_over:
            continue
        yield (
            index[id(f)],
            routed_samples(result, return_routes),
            result.weight_version,
            result.sample_versions,
        )
