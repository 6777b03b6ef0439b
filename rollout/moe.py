"""The sparse layer of a mixture of experts (Qwen3-MoE, Qwen2-MoE), as Hugging Face computes it.

Per token: router logits `gate(x)` [E], a softmax in `accum_dtype` (float32, float64 for a float64
model), the top-k probabilities (renormalised to sum to one with `norm_topk_prob`) cast back to
the model dtype as routing weights; the output is the weighted sum of the k chosen experts'
SwiGLU outputs, added in ascending expert order (HF's order: each expert's rows are
`index_add_`ed into zeros in turn), plus Qwen2-MoE's shared expert scaled by
sigmoid(shared_expert_gate(x)).

Experts run per expert group: the (token, slot) pairs are sorted by expert once, and each expert
that received tokens multiplies exactly its rows (one matrix multiply per projection per active
expert; no padding, no dense all-experts pass). Under tensor parallelism each expert holds its
share of the intermediate dimension like the dense MLP (gate/up by output rows, down_proj by
input columns); the router is replicated, so every rank picks the same experts from the same
(all-reduced) hidden states, and the experts' partial outputs are summed once, one all-reduce per
layer instead of one per expert.

Parameter names are Hugging Face's per-expert checkpoint names (`mlp.gate.weight`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`),
so checkpoints and weight updates load by name as for a dense model.

The top-k ids of the last forward stay in `routes` [T, k]: the engine records them for every
token it computes (`rollout.routes`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_spec import ModelSpec
from rollout.config import accum_dtype
from rollout.tp_group import TPGroup


class SparseMoE(nn.Module):
    # The dense MLP's fused gate/up weight: none here, so fused fast paths written for the dense
    # MLP (`rollout.native.layers`) call `forward` instead.
    gate_up_weight = None

    def __init__(self, cfg: ModelSpec, tp: TPGroup | None, expert: type[nn.Module]):
        """`expert`: the dense SwiGLU module (`rollout.model.MLP`), built here at the experts'
        widths; it provides `partial` (this rank's share, not yet all-reduced) and
        `fuse_projections`."""
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k, self.norm_topk_prob = (
            moe.num_experts,
            moe.top_k,
            moe.norm_topk_prob,
        )
        self.tp = tp
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            expert(cfg, tp, moe.expert_intermediate_size) for _ in range(moe.num_experts)
        )
        if moe.shared_expert_intermediate_size:
            self.shared_expert = expert(cfg, tp, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.routes: torch.Tensor | None = None  # [T, k] expert ids of the last forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k] in x's dtype, expert ids [T, k]), HF's `TopKRouter`."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=accum_dtype(logits.dtype))
        top, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        self.routes = ids
        out = torch.zeros_like(x)
        flat = ids.flatten()  # (token, slot) pairs, token-major
        order = flat.argsort(stable=True)  # grouped by expert, tokens ascending within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            y = self.experts[e].partial(x[tokens]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, y)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def fuse_projections(self, column_major: bool) -> None:
        """Each expert's gate/up in one tensor (and the shared expert's), as the dense MLP's."""
        for expert in self.experts:
            expert.fuse_projections(column_major)
        if self.shared_expert is not None:
            self.shared_expert.fuse_projections(column_major)


def check_moe_divisible(cfg: ModelSpec, tp_size: int) -> None:
    """One line naming the expert width k must divide."""
    moe = cfg.moe
    if moe is None:
        return
    for what, value in (
        ("moe_intermediate_size", moe.expert_intermediate_size),
        ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size),
    ):
        if value % tp_size:
            raise ValueError(
                f"EngineConfig.tp={tp_size} must divide the model's {what}={value}; choose a "
                "divisor of it"
            )
