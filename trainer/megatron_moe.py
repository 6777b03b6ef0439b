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
gated `SharedExpertMLP` (sigmoid of a [1, hidden] gate, HF's `shared_expert_gate`).

The load-balancing loss (`TrainerConfig.moe_aux_loss_coeff`) is megatron's switch loss per sparse
layer and micro-batch, E * sum_i f_i P_i (f_i: the share of the micro-batch's top-k slots routed
to expert i by the trainer's own top-k, replayed routes or not; P_i: the mean router probability
of expert i over the softmax of all experts), computed on the rows each router sees. The step's
loss gains coeff x the sum over sparse layers of its mean over micro-batches (each DP rank's
micro-batches equally weighted, each DP rank 1/DP: `aux_loss_scale`); it adds gradient to the
routers only (f_i is a count).

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


def moe_config_fields(
    arch: ModelSpec, params_dtype: torch.dtype, aux_loss_coeff: float = 0.0
) -> dict[str, Any]:
    """`TransformerConfig` keyword arguments of `arch`'s experts; {} for a dense model.
    `aux_loss_coeff` > 0 turns on megatron's switch load-balancing loss (`aux_loss`: the
    router's class is chosen at construction; the coefficient is set per step,
    `MegatronModel.train_micro_batches`)."""
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
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_router_dtype="fp64" if params_dtype == torch.float64 else "fp32",
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=aux_loss_coeff,
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


_AUX_LOSS = "load_balancing_loss"  # megatron's tracker entry of the `aux_loss` type


def start_aux_loss_step(config, coeff: float, share: int) -> None:
    """Before a training step's micro-batches: each micro-batch's switch loss is weighted
    1 / `share` (this rank's micro-batches x DP ranks), and megatron's per-layer tracker
    (process-wide, summing the unscaled loss over micro-batches) starts from zero.

    The routers were built without megatron's per-token scaling (`calculate_per_token_loss` is
    set on the config after the model is built), and the schedule's backward scale is 1 under
    per-token losses, so the gradient a router gets from one micro-batch is exactly the
    coefficient it reads from `config` times d(switch loss); DDP then sums over DP ranks."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    config.moe_aux_loss_coeff = coeff / share
    clear_aux_losses_tracker()


def aux_loss_share(num_sparse_layers: int, share: int) -> torch.Tensor:
    """This rank's share of the step's load-balancing loss: its layers' tracked switch losses
    summed, over `num_sparse_layers` x `share` (`start_aux_loss_step`); summed over DP ranks and
    pipeline stages it is the mean over sparse layers of the micro-batch mean (1.0 when every
    micro-batch is balanced)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(_AUX_LOSS)
    if entry is None:  # this stage holds no sparse layer
        return torch.zeros((), dtype=torch.float64)
    return entry["values"].sum().double() / (num_sparse_layers * share)
