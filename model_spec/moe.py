"""The mixture-of-experts part of a Qwen3-MoE / Qwen2-MoE `config.json`, as transformers reads it.

Layer i is sparse (a router over `num_experts` SwiGLU experts, each token sent to its top
`top_k`) when i is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`; every
other layer keeps the dense MLP of `intermediate_size`. The router's softmax runs in float32 at
least (float64 for a float64 model), the top-k probabilities are renormalised to sum to one when
`norm_topk_prob`, and Qwen2-MoE adds a shared expert to every sparse layer, scaled by
sigmoid(shared_expert_gate(x)).

transformers 5 writes `num_local_experts` where Qwen's own checkpoints write `num_experts`
(`Qwen3MoeConfig.attribute_map`); both are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_spec.errors import UnsupportedModelError

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
# transformers' `Qwen2MoeConfig` / `Qwen3MoeConfig` defaults for keys a config.json leaves out
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
    ),
    "qwen3_moe": dict(
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        shared_expert_intermediate_size=0,
    ),
}


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int  # experts per token (`num_experts_per_tok`)
    expert_intermediate_size: int  # each expert's SwiGLU width (`moe_intermediate_size`)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to one
    sparse_layers: tuple[int, ...]  # the layers with a router and experts, ascending
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none

    def __post_init__(self):
        self.check_integrity()

    def check_integrity(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"config.json num_experts_per_tok={self.top_k} must be in [1, num_experts="
                f"{self.num_experts}]"
            )
        if list(self.sparse_layers) != sorted(set(self.sparse_layers)):
            raise ValueError("MoESpec.sparse_layers must be ascending and distinct")

    @property
    def num_sparse_layers(self) -> int:
        return len(self.sparse_layers)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def moe_from_hf(hf: dict[str, Any], num_layers: int) -> MoESpec | None:
    """The MoE fields of a `qwen2_moe` / `qwen3_moe` config.json dict; None when every layer is
    dense (`num_experts` 0, or no layer sparse)."""
    defaults = _MOE_DEFAULTS[hf["model_type"]]

    def get(key: str, default: Any) -> Any:
        value = hf.get(key)
        return default if value is None else value

    num_experts = int(get("num_experts", get("num_local_experts", defaults["num_experts"])))
    step = int(get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedModelError(f"config.json decoder_sparse_step={step} must be >= 1")
    dense_only = {int(i) for i in get("mlp_only_layers", [])}
    sparse = tuple(
        i
        for i in range(num_layers)
        if num_experts > 0 and i not in dense_only and (i + 1) % step == 0
    )
    if not sparse:
        return None
    shared = (
        int(get("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"]))
        if hf["model_type"] == "qwen2_moe"
        else 0
    )
    return MoESpec(
        num_experts=num_experts,
        top_k=int(get("num_experts_per_tok", defaults["num_experts_per_tok"])),
        expert_intermediate_size=int(
            get("moe_intermediate_size", defaults["moe_intermediate_size"])
        ),
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
    )
