"""A mixture of experts (Qwen3-MoE, Qwen2-MoE) in megatron-core: the `TransformerConfig` fields
and the decoder block spec that build HF's sparse layers.

HF's router takes the top-k of softmax(logits), renormalised to sum to one with
`norm_topk_prob`; megatron's top-k router with `moe_router_pre_softmax=False` takes the top-k
logits and a softmax over them, the same renormalised probabilities, and with `True` the top-k of
the full softmax, HF's unnormalised ones. The router runs in the model's float dtype (fp64 for a
float64 model, else fp32). Experts are megatron's `SequentialMLP` (one `MLP` per expert, fc1 =
[gate; up] like the dense MLP's, split over TP like it: expert TP = TP, expert parallel 1).
Sparse layers follow `MoESpec.sparse_layers` (`moe_layer_freq` as a per-layer list); Qwen2-MoE's
shared expert is megatron's gated `SharedExpertMLP` (sigmoid of a [1, hidden] gate, HF's
`shared_expert_gate`).

Tokens under TP: this trainer runs without sequence parallelism, so every TP rank holds every
token. megatron's all-gather dispatcher assumes sequence parallelism: it would gather each token
TP times, every expert shard would see it TP times and its gradient would be TP times too large
(megatron refuses to train that way). `ReplicatedTokensDispatcher` (megatron's, patched in for
EP = 1 without sequence parallelism) gathers nothing: each rank's expert shards compute their
share of the intermediate dimension for every token, the shares are summed by one all-reduce per
layer (the dense row-parallel MLP's pattern, and the engine's), and the backward all-reduces
the gradients of the experts' inputs and gate weights (each rank's is partial), so the
replicated router gets its whole gradient. `allow_tensor_parallel_training` lets the layers pass
megatron's refusal. Expert parallelism (EP > 1) needs megatron's all-to-all dispatcher: CUDA
only, not built here.

The load-balancing loss (`TrainerConfig.moe_aux_loss_coeff`) is megatron's switch loss per sparse
layer and micro-batch, E * sum_i f_i P_i (f_i: the share of the micro-batch's top-k slots routed
to expert i by the trainer's own top-k, replayed routes or not; P_i: the mean router probability
of expert i over the softmax of all experts), computed on the rows each router sees. The step's
loss gains coeff x the sum over sparse layers of its mean over micro-batches (each DP rank's
micro-batches equally weighted, each DP rank 1/DP: `start_aux_loss_step`); it adds gradient to the
routers only (f_i is a count).

Fixes to megatron-core 0.16.1 (`patch_megatron_moe`, idempotent; the dispatcher above is the
third): its router's autograd
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

import collectives
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


class _SumGradsOverTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over `group`. megatron's own
    (`copy_to_tensor_model_parallel_region`) all-reduces `grad.contiguous()` and returns `grad`:
    a non-contiguous gradient (the experts' gate weights give one, through a transposed
    selection) would come back unsummed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad.contiguous(), group=ctx.group), None


class _SumOverTP(torch.autograd.Function):
    """The forward sums `x` over `group`; the backward is the identity (every rank's share
    gets the whole output's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        return collectives.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _replicated_tokens_dispatcher():
    """megatron's all-gather dispatcher for tokens replicated over TP (no sequence parallelism),
    expert parallel 1 (module docstring); with sequence parallelism or EP > 1, megatron's own."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class ReplicatedTokensDispatcher(MoEAllGatherTokenDispatcher):
        def _replicated(self) -> bool:
            return self.tp_size > 1 and self.ep_size == 1 and not self.config.sequence_parallel

        def token_dispatch(self, hidden_states, probs):
            if not self._replicated():
                return super().token_dispatch(hidden_states, probs)
            # every rank holds every token: nothing to gather; each rank's experts give the
            # inputs and the gate weights a partial gradient, summed over TP in the backward
            return (
                _SumGradsOverTP.apply(hidden_states, self.tp_group),
                _SumGradsOverTP.apply(probs, self.tp_group),
            )

        def token_combine(self, hidden_states):
            if not self._replicated():
                return super().token_combine(hidden_states)
            # each rank's experts computed a share of the intermediate dimension: sum them
            summed = _SumOverTP.apply(hidden_states.to(self.local_probs.dtype), self.tp_group)
            return summed.to(hidden_states.dtype)

    return ReplicatedTokensDispatcher


def allow_tensor_parallel_training(model: torch.nn.Module) -> None:
    """megatron's `MoELayer.forward` refuses to train under TP without sequence parallelism
    (its dispatcher would all-gather every token TP times); under `ReplicatedTokensDispatcher`
    no token is duplicated, so each MoE layer gets a copy of the config that passes that check
    (the only place `MoELayer` reads `sequence_parallel`; its router, experts and dispatcher
    keep the model's config)."""
    import copy

    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer) and not module.config.sequence_parallel:
            module.config = copy.copy(module.config)
            module.config.sequence_parallel = True


def patch_megatron_moe() -> None:
    """The fixes of the module docstring (after `trainer.cpu_compat.apply`)."""
    from megatron.core.transformer.moe import moe_layer, moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(moe_utils.torch, _WideSoftmaxTorch):
        moe_utils.torch = _WideSoftmaxTorch(moe_utils.torch)
    if moe_layer.MoEAllGatherTokenDispatcher.__name__ != "ReplicatedTokensDispatcher":
        moe_layer.MoEAllGatherTokenDispatcher = _replicated_tokens_dispatcher()


_AUX_LOSS = "load_balancing_loss"  # megatron's tracker entry of the `aux_loss` type


def start_aux_loss_step(config, coeff: float, share: int) -> None:
    """Before a training step's micro-batches: each micro-batch's switch loss is weighted
    1 / `share` (this rank's micro-batches x DP ranks), and megatron's per-layer tracker
    (process-wide, summing the unscaled loss over micro-batches) starts from zero.

    The routers were built without megatron's per-token scaling (`calculate_per_token_loss` is
    set on the config after the model is built), and the schedule's backward scale is 1 under
    per-token losses, so the gradient a router gets from one micro-batch is exactly the
    coefficient it reads from `config` times d(switch loss); DDP then sums over DP ranks.

    Under TP, megatron's switch loss assumes each rank holds 1 / TP of the tokens (sequence
    parallelism: it counts the experts' tokens over the TP group and divides by TP x its own
    count); with every token on every rank it computes 1 / TP of the loss, so the coefficient
    is TP times larger and the tracked value TP times smaller (`aux_loss_share`)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    config.moe_aux_loss_coeff = coeff * _token_replicas(config) / share
    clear_aux_losses_tracker()


def _token_replicas(config) -> int:
    """How many TP ranks hold each token in a MoE layer (all of them without sequence
    parallelism)."""
    return 1 if config.sequence_parallel else config.tensor_model_parallel_size


def aux_loss_share(config, num_sparse_layers: int, share: int) -> torch.Tensor:
    """This rank's share of the step's load-balancing loss: its layers' tracked switch losses
    summed, over `num_sparse_layers` x `share` (`start_aux_loss_step`); summed over DP ranks and
    pipeline stages it is the mean over sparse layers of the micro-batch mean."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(_AUX_LOSS)
    if entry is None:  # this stage holds no sparse layer
        return torch.zeros((), dtype=torch.float64)
    return entry["values"].sum().double() * _token_replicas(config) / (num_sparse_layers * share)
