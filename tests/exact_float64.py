"""HF transformers as an exact float64 reference.

HF computes its RMSNorms and rotary angles in float32 whatever the model dtype, and a mixture of
experts' router its softmax; `exact_float64` replaces those islands with float64 modules (sharing
the model's norm weights, so parameter names and objects are unchanged) or, for the routers, a
float64 `forward` on the same module (its router-logit hooks stay), so a float64 HF forward is
float64 throughout.
"""

from __future__ import annotations

import types

import torch


class Float64Rotary(torch.nn.Module):
    """HF's default rotary embedding (cos, sin of the "rotate half" layout), all in float64."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        )

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Float64RMSNorm(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        x = x.double()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _float64_route(router, hidden_states):
    """HF's `TopKRouter.forward` with the softmax and the top-k normalisation in float64."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float64)
    top, indices = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), indices


def exact_float64(model):
    """`model` (float64, default rope) with every float32 island of its forward replaced."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    model.model.rotary_emb = Float64Rotary(head_dim, cfg.rope_parameters["rope_theta"])
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(module, name, Float64RMSNorm(child))
            elif type(child).__name__.endswith("TopKRouter"):
                child.forward = types.MethodType(_float64_route, child)
    return model
