"""Routing replay: a mixture of experts' trainer forward routes each token to the experts the
engine routed it to, with gate weights from the trainer's own router logits.

A tiny numeric difference between engine and trainer flips a top-k choice, and the trained
policy is then not the one that sampled. So the routes the engine recorded
(`RLBatch.routed_experts`: per sample [tokens - 1 or tokens, sparse layers, k], row q the experts
of the token at position q) are laid out like the packed micro-batch's rows (`packed_routes`)
and handed to megatron-core's router replay for the forward of each micro-batch: the experts
are the given ones, their gate weights the trainer's own softmax gathered at them, so gradients
reach the router through the gate weights. A position with no route (the last token when the
engine returned tokens - 1 rows: its output feeds no logit that is read) is routed by the
trainer's own top-k.

`RouteReplay` is megatron's `RouterReplay` with three differences: it belongs to one model's
router and not to megatron's process-wide list (that list mixes the routers of every model
built in the process: policy, reference, the sampling copy), rows without a route fall back to
the trainer's own choice, and it counts how many (token, sparse layer) top-k sets the trainer's
own router would pick equal the replayed ones (`train/routing_agreement`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

import collectives
from trainer.packing import MicroBatch, prompt_groups

NO_ROUTE = -1  # a packed row whose route is not given: the trainer's own top-k routes it


class RouteReplay(RouterReplay):
    """One router's replay: `target` [t, k] long expert ids per packed row (NO_ROUTE rows route
    themselves); `rows`: the packed rows the router sees when it sees fewer than all (the last
    layer under `response_rows`)."""

    def __init__(self):
        super().__init__()
        # megatron's constructor registers every instance process-wide; this one is driven
        # through its own model's routers only (module doc)
        RouterReplay.global_router_replay_instances.remove(self)
        self.rows: torch.Tensor | None = None
        self.agree = 0  # replayed rows whose set equals the trainer's own top-k
        self.counted = 0  # replayed rows

    def replay(self, target: torch.Tensor, rows: torch.Tensor | None) -> None:
        self.target_topk_idx, self.rows = target, rows
        self.router_replay_action = RouterReplayAction.REPLAY_FORWARD

    def stop(self) -> None:
        self.target_topk_idx, self.rows, self.router_replay_action = None, None, None

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        compute = default_compute_topk
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, compute)
        target = self.target_topk_idx.to(scores.device)
        if target.shape[0] != scores.shape[0]:
            if self.rows is None or len(self.rows) != scores.shape[0]:
                raise ValueError(
                    f"routes for {target.shape[0]} packed rows; the router sees {scores.shape[0]}"
                )
            target = target.index_select(0, self.rows.to(scores.device))
        if target.shape[1] != topk:
            raise ValueError(f"routes give {target.shape[1]} experts a token; the model's k={topk}")
        _, own = compute(scores, topk, num_groups=num_groups, group_topk=group_topk)
        given = target[:, 0] != NO_ROUTE
        indices = torch.where(given[:, None], target, own)
        same = (indices.sort(dim=1).values == own.sort(dim=1).values).all(dim=1)
        self.agree += int(same[given].sum())
        self.counted += int(given.sum())
        # as megatron's replay: the gate weights are the trainer's scores at the given experts
        return scores.gather(1, indices), indices


def install(model: torch.nn.Module, sparse_layers: Sequence[int]) -> list[tuple[int, RouteReplay]]:
    """A `RouteReplay` on every router of `model` (this pipeline stage's); returns (column of
    the routes' sparse-layer dimension, replay) per router."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.router_replay = RouteReplay()
            out.append((list(sparse_layers).index(module.layer_number - 1), module.router_replay))
    return out


def packed_routes(
    mb: MicroBatch,
    tokens: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    routes: Sequence[torch.Tensor],
) -> torch.Tensor:
    """[t, sparse layers, k] long: the route of each packed row of `mb` (`trainer.packing`'s
    layout: a shared prompt's rows are its first member's), NO_ROUTE where none is given.
    `tokens`, `prompt_lens`, `routes` are indexed like `mb.sample_indices`."""
    missing = [i for i in mb.sample_indices if routes[i] is None]
    if missing:
        raise ValueError(
            f"batch.routed_experts: no routes for samples {missing} of this rank's micro-batch; "
            "a rank must be given the routes of every sample it trains on"
        )
    if mb.shared is None:
        groups = [[i] for i in mb.sample_indices]
    else:
        groups = prompt_groups(tokens, prompt_lens, mb.sample_indices)
    first = routes[mb.sample_indices[0]]
    out = torch.full((mb.num_tokens, first.shape[1], first.shape[2]), NO_ROUTE, dtype=torch.long)
    row = 0
    for members in groups:
        p = int(prompt_lens[members[0]])
        spans = [(members[0], 0, p)] + [(i, p, len(tokens[i])) for i in members]
        for i, start, end in spans:
            have = routes[i][start:end]
            out[row : row + len(have)] = have.long()
            row += end - start
    if row != mb.num_tokens:
        raise AssertionError(f"laid out {row} route rows for {mb.num_tokens} packed rows")
    return out


def agreement(replays: Sequence[tuple[int, RouteReplay]]) -> float:
    """Share of the replayed (token, sparse layer) top-k sets the trainer's own router picks too,
    over every rank's routers since the last `reset` (1.0 when none was replayed); a
    collective when torch.distributed is initialized."""
    counts = torch.tensor(
        [sum(r.agree for _, r in replays), sum(r.counted for _, r in replays)], dtype=torch.float64
    )
    if torch.distributed.is_initialized():  # on the group's device, read back once
        counts = collectives.all_reduce(counts)
    agree, counted = counts.tolist()
    return agree / counted if counted else 1.0


def reset(replays: Sequence[tuple[int, RouteReplay]]) -> None:
    for _, r in replays:
        r.agree = r.counted = 0
        r.stop()
