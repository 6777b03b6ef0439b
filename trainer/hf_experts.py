"""A Hugging Face mixture's experts under their checkpoint names.

transformers 5 holds the experts of a sparse layer fused (`mlp.experts.gate_up_proj`
[experts, 2 x intermediate, hidden], gate rows first, and `mlp.experts.down_proj` [experts,
hidden, intermediate]); checkpoints, the engine and the megatron bridge name them per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`). `per_expert` gives a parameter stream the
checkpoint's names: every other tensor passes through unchanged, each fused one becomes its
experts' views, in expert order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def per_expert(
    named: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            if leaf == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
