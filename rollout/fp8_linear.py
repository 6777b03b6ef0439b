"""Linear layers holding block-wise FP8 weights (`EngineConfig.quantization="fp8"`).

`Fp8Linear` replaces a decoder layer's nn.Linear (q/k/v/o, gate/up/down, experts; see
`quantization.is_quantized_weight`) with the same Hugging Face names: `weight` becomes the
float8_e4m3fn tensor [out, in] and `weight_scale_inv` its float32 block scales [ceil(out / 128),
ceil(in / 128)]; the bias stays in the model dtype. It computes x @ dequantize(weight).T in the
activations' dtype: weights-only quantization, so the FP8 engine is exactly a bf16 / fp32 engine
running the dequantized weights (the activations are never rounded to FP8). On an accelerator
the weights are dequantized on the fly, one layer at a time, at every forward: the engine's
memory holds FP8, which is the point there; a fused FP8 GEMM (`torch._scaled_mm` with block
scales) would also round the activations to FP8, a different function. On a CPU, where
dequantizing every weight at every forward is most of a decode step's time, each layer keeps its
dequantized weight (in the activations' dtype) once built, so a CPU engine saves the sync's
bytes, not memory. The FP8 weight and its scales stay the layer's canonical weights (what is
loaded and checked); the dequantized copy is keyed by their version counters (and storage
addresses): every in-place load (`copy_`, whichever path: an update, a bucketed load, a tensor-
parallel follower's shard) bumps a counter, which a storage swap (`release_storage` /
`restore_storage`) keeps, so the copy is rebuilt at the first forward after any change and is
never stale; a release drops it.

Under tensor parallelism a column- or row-parallel linear keeps its `Shard`, and its scales are
sharded by blocks along the same dimension. The FP8 blocks must not straddle two ranks' shards
(a weight quantized whole by the sender is then exactly the concatenation of the ranks'
quantized shards), so a sharded dimension's share must be a multiple of 128 (`check_shards`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantization import BLOCK, FP8_DTYPE, dequantize, is_quantized_weight, scale_shape
from rollout.parallel_layers import RowParallelLinear, Shard
from rollout.tp_group import TPGroup


class Fp8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: nn.Parameter | None,
        dtype: torch.dtype,
        shard: Shard | None = None,
        tp: TPGroup | None = None,
    ):
        """`dtype`: the model's, which a weight given in full precision is cast to before it is
        quantized (the weight a `dtype` engine would hold); `shard`: how a parallel layer's
        weight is cut from the full one; `tp`: set for a row-parallel layer, whose partial
        products are all-reduced before the bias."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape((out_features, in_features)), dtype=torch.float32),
            requires_grad=False,
        )
        self.bias = bias
        self.shard = shard
        self.tp = tp
        # CPU only: (key of the FP8 weight and scales it came from, the dequantized weight)
        self._dequantized: tuple[tuple, torch.Tensor] | None = None

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An FP8 layer of `linear`'s shape, dtype and sharding, its bias Parameter kept (on
        the device `linear` is on: the meta device while a model is built)."""
        with torch.device(linear.weight.device):
            return cls(
                linear.in_features,
                linear.out_features,
                linear.bias,
                linear.weight.dtype,
                getattr(linear, "shard", None),
                linear.tp if isinstance(linear, RowParallelLinear) else None,
            )

    def shards(self) -> dict[str, Shard]:
        if self.shard is None:
            return {}
        s = self.shard
        blocks = Shard(s.dim, s.start // BLOCK, -(-s.length // BLOCK), -(-s.full // BLOCK))
        out = {"weight": s, "weight_scale_inv": blocks}
        if self.bias is not None and self.tp is None:  # a column-parallel bias is sliced too
            out["bias"] = s
        return out

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's weight dequantized to `dtype`: built at every call on an accelerator,
        kept on a CPU until the FP8 weight or its scales change."""
        weight, scale = self.weight, self.weight_scale_inv
        if weight.device.type != "cpu":
            return dequantize(weight, scale, dtype)
        key = (weight.data_ptr(), weight._version, scale.data_ptr(), scale._version, dtype)
        if self._dequantized is None or self._dequantized[0] != key:
            self._dequantized = (key, dequantize(weight, scale, dtype))
        return self._dequantized[1]

    @property
    def keeps_dequantized(self) -> bool:
        """Whether a dequantized copy of the weight is kept (on a CPU, after a forward)."""
        return self._dequantized is not None

    def forget_dequantized(self) -> None:
        """Drop the kept dequantized weight (its memory goes back with the FP8 storage)."""
        self._dequantized = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with this rank's weight, no bias and no all-reduce."""
        return F.linear(x, self.dequantized_weight(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks"


def quantize_linears(model: nn.Module) -> None:
    """Replace, in place, every nn.Linear whose weight `quantization.is_quantized_weight` names
    with an `Fp8Linear` of the same shape and sharding (values not kept: call it on a model
    being built, before its parameters are materialised and loaded)."""
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            name = f"{prefix}.{child_name}.weight" if prefix else f"{child_name}.weight"
            if isinstance(child, nn.Linear) and is_quantized_weight(name):
                setattr(module, child_name, Fp8Linear.like(child))


def check_shards(model: nn.Module, tp_size: int) -> None:
    """One line if an FP8 block would straddle two tensor-parallel shards."""
    for prefix, module in model.named_modules():
        shard = getattr(module, "shard", None)
        if isinstance(module, Fp8Linear) and shard is not None and shard.length % BLOCK:
            raise ValueError(
                f"EngineConfig.quantization='fp8' with tp={tp_size}: {prefix}.weight is split "
                f"into shards of {shard.length} along dim {shard.dim}, and its 128-wide FP8 "
                "blocks must not straddle shards; use a tp that leaves multiples of 128 per "
                "rank, or quantization null"
            )
