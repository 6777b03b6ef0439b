"""Tensor-parallel layers of the decoder: each rank holds a slice of a full Hugging Face weight.

* `ColumnParallelLinear`: output features [start, start + length) (q/k/v by heads, gate/up, the
  LM head by vocabulary rows); its output stays sharded.
* `RowParallelLinear`: input features [start, start + length) (o_proj, down_proj); partial
  products are all-reduced, then the (replicated) bias is added once.
* `VocabParallelEmbedding`: vocabulary rows [start, start + length); ids outside give zeros and
  the all-reduce sums exactly one non-zero row per token.

Parameter names stay the Hugging Face names, and every sliced parameter records how it was
sliced (`shard_spec`), so `rollout.weights.load_weights` narrows full tensors to this rank's
share (the weight sync sends what it sends today) and copies pre-sharded tensors as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rollout.tp_group import TPGroup


class Shard(NamedTuple):
    dim: int  # the sliced dimension of the full tensor
    start: int
    length: int
    full: int  # the full tensor's size along `dim`

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, full_out: int, start: int, length: int, bias: bool):
        super().__init__(in_features, length, bias=bias)
        self.shard = Shard(0, start, length, full_out)

    def shards(self) -> dict[str, Shard]:
        return {"weight": self.shard, **({"bias": self.shard} if self.bias is not None else {})}


class RowParallelLinear(nn.Linear):
    def __init__(
        self, full_in: int, out_features: int, start: int, length: int, bias: bool, tp: TPGroup
    ):
        super().__init__(length, out_features, bias=bias)
        self.shard = Shard(1, start, length, full_in)
        self.tp = tp

    def shards(self) -> dict[str, Shard]:
        return {"weight": self.shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def uninitialised_embedding(num: int, dim: int) -> nn.Embedding:
    """`nn.Embedding(num, dim)` with its weight left as allocated: `nn.Embedding` would fill it
    with `normal_`, whose meta-device kernel is a Python decomposition that imports dynamo
    (seconds of CPU in every engine process), and the checkpoint's weights replace it anyway."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def embedding(vocab: int, hidden: int, tp: TPGroup | None) -> nn.Embedding:
    """The token embedding, or this rank's share of the vocabulary; uninitialised either way."""
    return (
        uninitialised_embedding(vocab, hidden)
        if tp is None
        else VocabParallelEmbedding(vocab, hidden, tp)
    )


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, tp: TPGroup):
        start, length = tp.vocab_split(vocab)
        super().__init__(length, hidden, _weight=torch.empty(length, hidden))  # as above
        self.shard = Shard(0, start, length, vocab)
        self.tp = tp

    def shards(self) -> dict[str, Shard]:
        return {"weight": self.shard}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.length)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def column(
    in_features: int, out_features: int, bias: bool, tp: TPGroup | None, unit: int = 1
) -> nn.Linear:
    """nn.Linear, or this rank's even share of its outputs (split in whole `unit`s: heads)."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    start, length = tp.split(out_features // unit)
    return ColumnParallelLinear(in_features, out_features, start * unit, length * unit, bias)


def row(
    in_features: int, out_features: int, bias: bool, tp: TPGroup | None, unit: int = 1
) -> nn.Linear:
    """nn.Linear, or this rank's even share of its inputs, all-reduced."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    start, length = tp.split(in_features // unit)
    return RowParallelLinear(in_features, out_features, start * unit, length * unit, bias, tp)


def lm_head(hidden: int, vocab: int, tp: TPGroup | None) -> nn.Linear:
    if tp is None:
        return nn.Linear(hidden, vocab, bias=False)
    start, length = tp.vocab_split(vocab)
    return ColumnParallelLinear(hidden, vocab, start, length, bias=False)


def shard_spec(model: nn.Module) -> dict[str, Shard]:
    """Parameter name -> how it is sliced from the full tensor; unlisted parameters are whole."""
    spec: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        # the parallel layers here, and `rollout.fp8_linear.Fp8Linear` holding one's shard
        if callable(getattr(module, "shards", None)):
            for name, shard in module.shards().items():
                spec[f"{prefix}.{name}"] = shard
    return spec


def check_divisible(
    num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int
) -> None:
    """One line naming the model dimension k must divide (the vocabulary need not divide)."""
    for what, value in (
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
        ("intermediate_size", intermediate_size),
    ):
        if value % tp_size:
            raise ValueError(
                f"EngineConfig.tp={tp_size} must divide the model's "
                f"{what}={value}; choose a divisor of it"
            )
