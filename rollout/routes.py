"""Routed experts beside the KV pages: which experts each computed token went to.

For a mixture of experts the engine records, for every token it computes (prompt and sampled),
the top-k expert ids of each sparse layer, so a trainer can replay the routes the sampling
policy took (rollout routing replay). They are kept per KV slot, in a tensor parallel to the
pool's K/V (`KVPool.routes`, [slots, sparse layers, k]): the forward that writes a token's K/V
writes its routes to the same slot (`record_routes`). Everything that moves or shares K/V
therefore moves or shares routes with it: a prefix-cache hit reads the routes of the pages it
reuses (those of the prefill that computed them, the same K/V the hit attends to), forks share
their prompt's pages, a partly filled page copied for a fork copies its routes, parked K/V keeps
them. When a sequence gives its pages back (finished, aborted, preempted) its routes are read
out first (`read_routes`), so a preempted sample keeps them until its recompute writes them
again.

A sample's routes cover `token_ids[:m]`, m = prompt + generated - 1 for a sample that finished:
every token that was an input to the model (the last sampled token never is). They are stored
in the smallest integer dtype that holds every expert id (`route_dtype`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_spec import MoESpec


def route_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 256 experts, int16 up to 32768, else int32."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


class RouteLayout(NamedTuple):
    """What one slot's routes hold: `top_k` expert ids for each of `num_layers` sparse layers."""

    num_layers: int
    top_k: int
    dtype: torch.dtype

    @classmethod
    def of(cls, moe: MoESpec | None) -> RouteLayout | None:
        """The layout of a model's routes; None for a dense model (nothing recorded)."""
        if moe is None:
            return None
        return cls(moe.num_sparse_layers, moe.top_k, route_dtype(moe.num_experts))

    def empty(self) -> torch.Tensor:
        """No tokens' routes: [0, layers, k] on the CPU."""
        return torch.empty((0, self.num_layers, self.top_k), dtype=self.dtype)


def record_routes(routes: torch.Tensor | None, store: torch.Tensor | None, slots: torch.Tensor):
    """After a forward: the routes [T, layers, k] of its T tokens into `store` [slots, layers, k]
    at the tokens' K/V slots. Nothing for a dense model or a pool without route storage (a
    tensor-parallel follower's: rank 0 records)."""
    if routes is not None and store is not None:
        store.index_copy_(0, slots, routes.to(store.dtype))


def read_routes(
    store: torch.Tensor, slot_table: torch.Tensor, row: int, count: int
) -> torch.Tensor:
    """The routes of positions [0, count) of slot-table row `row`, on the CPU."""
    return store[slot_table[row, :count]].cpu()
