"""Routing replay on a Hugging Face mixture of experts (the deepspeed backend's model): each
router's top-k replaced by the engine's routes, gate weights from the router's own logits, as
`trainer.routing_replay` does in megatron.

HF's routers (`Qwen3MoeTopKRouter`, `Qwen2MoeTopKRouter`) return (logits, top-k weights, top-k
ids) for the rows of the padded [sequences, longest] batch, flattened. A forward hook replaces
the last two: the ids are the given ones where the row has a route, else the router's own; the
weights are HF's own computation at those ids (softmax of the logits in float32, gathered,
renormalised with `norm_topk_prob`, cast to the logits' dtype), so gradients reach the router
through them. Rows without a route (padding; a sample's last token when the engine gave
tokens - 1 rows) keep the router's choice. The hook counts how many replayed (token, sparse
layer) top-k sets the router would pick itself (`train/routing_agreement`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from trainer.config import RLBatch
from trainer.packing import MicroBatch
from trainer.routing_replay import NO_ROUTE, packed_routes


class HFRouteReplay:
    """Replay on the routers of `model`'s `sparse_layers` (a HF causal LM with
    `model.layers[i].mlp.gate` routers)."""

    def __init__(self, model: torch.nn.Module, sparse_layers: Sequence[int]):
        self.target: torch.Tensor | None = None  # [padded rows, sparse layers, k]
        self.counting = True
        self.agree = self.counted = 0
        for column, layer in enumerate(sparse_layers):
            router = model.model.layers[layer].mlp.gate
            router.register_forward_hook(self._hook(column))

    @classmethod
    def of(cls, model: torch.nn.Module) -> HFRouteReplay | None:
        """Replay on every router of the HF causal LM `model`; None for a dense model."""
        from model_spec import ModelSpec

        moe = ModelSpec.from_hf(model.config.to_dict()).moe
        return None if moe is None else cls(model, moe.sparse_layers)

    def _hook(self, column: int):
        def replace(router, args, output):
            if self.target is None:
                return output
            logits, _, own = output
            given = self.target[:, column].to(own.device)
            if given.shape != own.shape:
                raise ValueError(
                    f"routes for {given.shape[0]} padded rows of {given.shape[1]} experts; the "
                    f"router sees {own.shape[0]} rows of {own.shape[1]}"
                )
            has = given[:, 0] != NO_ROUTE
            indices = torch.where(has[:, None], given, own)
            if self.counting:
                same = (indices.sort(dim=1).values == own.sort(dim=1).values).all(dim=1)
                self.agree += int(same[has].sum())
                self.counted += int(has.sum())
            top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), indices

        return replace

    def replay(
        self,
        mb: MicroBatch,
        mask: torch.Tensor,
        tokens: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        routes: Sequence[torch.Tensor],
        counting: bool = True,
    ) -> None:
        """Route the next forward of `mb`, run as the padded rows of `mask` [sequences,
        longest], by `routes` (indexed like `mb.sample_indices`)."""
        packed = packed_routes(mb, tokens, prompt_lens, routes)
        target = torch.full((mask.numel(), *packed.shape[1:]), NO_ROUTE, dtype=torch.long)
        target[mask.flatten().bool()] = packed
        self.target, self.counting = target, counting

    def stop(self) -> None:
        self.target = None

    def take_agreement(self) -> float:
        """`routing_replay.agreement` for these routers: the share over every rank of the sets
        counted since the last call (1.0 when none was), which starts a new count; a collective
        when distributed."""
        import collectives

        counts = torch.tensor([self.agree, self.counted], dtype=torch.float64)
        if torch.distributed.is_initialized():
            counts = collectives.all_reduce(counts)
        agree, counted = counts.tolist()
        self.agree = self.counted = 0
        return agree / counted if counted else 1.0


def check_routes(replay: HFRouteReplay | None, batch: RLBatch) -> None:
    """Routes given for a model without routers are refused, never ignored."""
    if batch.routed_experts is not None and replay is None:
        raise ValueError("batch.routed_experts given for a dense model; it has no router")


def replaying(
    replay: HFRouteReplay | None,
    mb: MicroBatch,
    mask: torch.Tensor,
    local: RLBatch | None,
    counting: bool = True,
):
    """The forward of `mb` inside routes by `local.routed_experts` (the samples `mb` indexes)
    when `replay` and the routes are given; else it routes freely."""
    if replay is None or local is None or local.routed_experts is None:
        return contextlib.nullcontext()
    replay.replay(mb, mask, local.tokens, local.prompt_lens, local.routed_experts, counting)
    return _stopping(replay)


@contextlib.contextmanager
def _stopping(replay: HFRouteReplay):
    try:
        yield
    finally:
        replay.stop()
