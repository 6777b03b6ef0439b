"""A mixture of experts (Qwen3-MoE, Qwen2-MoE) in megatron-core: the `TransformerConfig` fields
and the decoder block spec that build HF's sparse layers.

HF's router takes the top-k of softmax(logits), renormalised to sum to one with
`norm_topk_prob`; megatron's top-k router with `moe_router_pre_softmax=False` takes the top-k
logits and a softmax over them, the same renormalised probabilities, and with `True` the top-k of
the full softmax, HF's unnormalised ones. The router runs in the model's float dtype (fp64 for a
float64 model, else fp32). Experts are megatron's `SequentialMLP` (one `MLP` per expert, fc1 =
[gate; up] like the dense MLP's; the bridge splits it over TP like it, though a mixture trains
at TP = 1: `megatron_model.transformer_config`), tokens dispatched by all-gather (expert
parallel 1; the all-to-all dispatcher needs CUDA streams). Sparse layers follow `MoESpec.
sparse_layers` (`moe_layer_freq` as a per-layer list); Qwen2-MoE's shared expert is megatron's
gated `SharedExpertMLP` (sigmoid of a [1, hidden] gate, HF's `shared_expert_gate`); no
load-balancing loss yet.

Two fixes to megatron-core 0.16.1 (`patch_megatron_moe`, idempotent): its router's autograd
function names Transformer Engine's GEMM even when TE is absent (`te_general_gemm`, never defined
then), defined here as None, the value its own check expects without TE; and its top-k routing
takes the softmax in float32 whatever the router dtype, which rounds a float64 model's routing
weights to float32: `moe_utils` gets a stand-in for its module-level `torch` (as
`trainer.cpu_compat` does for CUDA) whose `softmax` computes in the wider of the input's dtype
and the one asked for (float32 and bf16 models unchanged).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from model_spec import ModelSpec
from trainer.sdpa_attention import SDPACoreAttention


def moe_config_fields(arch: ModelSpec, params_dtype: torch.dtype) -> dict[str, Any]:
    """`TransformerConfig` keyword arguments of `arch`'s experts; {} for a dense model."""
    moe = arch.moe
    if moe is None:
        return {"moe_token_dispatcher_type": "alltoall"}  # unused; the default rejects the config
    shared = moe.shared_expert_intermediate_size
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_intermediate_size,
        moe_layer_freq=[int(moe.is_sparse(i)) for i in range(arch.num_layers)],
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp64" if params_dtype == torch.float64 else "fp32",
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0,
        # Qwen2-MoE: the shared expert, scaled by sigmoid(shared_expert_gate(x))
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
    )


def moe_block_spec(config):
    """megatron's decoder block spec for `config` (dense and sparse layers, this PP stage's), with
    `SDPACoreAttention` in every layer as in the dense spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


class _WideSoftmaxTorch(types.ModuleType):
    """`torch` for one megatron module: everything forwarded, `softmax` never narrower than its
    input."""

    def __init__(self, base):
        super().__init__("torch")
        self._base = base

    def __getattr__(self, name: str):
        return getattr(self._base, name)

    def softmax(self, input, dim, dtype=None):
        if dtype is not None:
            dtype = torch.promote_types(input.dtype, dtype)
        return self._base.softmax(input, dim=dim, dtype=dtype)


def patch_megatron_moe() -> None:
    """The two fixes of the module docstring (after `trainer.cpu_compat.apply`)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(moe_utils.torch, _WideSoftmaxTorch):
        moe_utils.torch = _WideSoftmaxTorch(moe_utils.torch)
