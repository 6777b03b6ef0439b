"""Build a megatron-core `GPTModel` (this rank's TP shard and PP stage) from a `ModelSpec`.

The layer spec is megatron's local one (`get_gpt_layer_local_spec`: ColumnParallelLinear /
RowParallelLinear, RMSNorm) with the core attention swapped for `SDPACoreAttention`, because
megatron's local core attention cannot take packed sequences. On GPUs with Transformer Engine
installed, `use_te=True` selects megatron's TE spec instead (its attention packs natively). A
mixture of experts takes megatron's decoder block spec with its MoE layers (`trainer.megatron_moe`).

RoPE: megatron's `RotaryEmbedding` knows the default formula and llama3 scaling with fixed
low/high-frequency factors and an 8192 original context; HF configs carry their own values.
We therefore install the shared parser's inverse frequencies (`model_spec.RopeSpec.inv_freq`,
HF's formula, the engine's too) in megatron's rotary module before the first forward, which
covers default / linear / llama3 exactly; `model_spec` refuses the other rope types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from model_spec import ModelSpec, UnsupportedModelError
from trainer import compiled, cpu_compat, packed_rope
from trainer.megatron_moe import (
    allow_tensor_parallel_training,
    moe_block_spec,
    moe_config_fields,
    patch_megatron_moe,
)
from trainer.parallel import device
from trainer.sdpa_attention import SDPACoreAttention


@dataclass(frozen=True)
class ModelLayout:
    """How this rank's model relates to the full HF model."""

    padded_vocab_size: int  # vocab rows in megatron (HF vocab padded to a TP-divisible size)
    layer_offset: int  # global index of this PP stage's first layer
    num_local_layers: int
    pre_process: bool  # this stage holds the embedding
    post_process: bool  # this stage holds the final norm and output layer


def padded_vocab_size(vocab_size: int, tp: int, multiple: int) -> int:
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """(offset, count) of the decoder layers on one pipeline stage.

    Every stage gets num_layers // pp layers and the first stage also takes the remainder
    (megatron's `num_layers_in_first_pipeline_stage`), e.g. 3 layers on 2 stages -> 2 + 1."""
    if num_layers < pp:
        raise ValueError(
            f"num_hidden_layers={num_layers} is smaller than "
            f"TrainerConfig.pp={pp}; use at most {num_layers} stages"
        )
    per = num_layers // pp
    first = num_layers - (pp - 1) * per
    if pp_rank == 0:
        return 0, first
    return first + (pp_rank - 1) * per, per


def transformer_config(
    arch: ModelSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    fused_swiglu: bool = False,
    moe_aux_loss_coeff: float = 0.0,
) -> TransformerConfig:
    if arch.o_bias or arch.mlp_bias:
        # megatron's add_bias_linear biases every linear at once; only q/k/v have their own flag
        key, what = ("attention_bias", "o_proj") if arch.o_bias else ("mlp_bias", "the MLP")
        raise UnsupportedModelError(
            f"config.json {key}=true with {arch.model_type} biases {what}, which the megatron "
            "trainer cannot build; use the deepspeed backend (trainer.backend: deepspeed)"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise ValueError(
            f"num_attention_heads={arch.num_heads} and num_key_value_heads="
            f"{arch.num_kv_heads} must both be divisible by TrainerConfig.tp={tp}; choose a "
            "smaller TP size"
        )
    if arch.moe is not None and pp > 1:
        raise ValueError(
            f"TrainerConfig.pp={pp} with the mixture of experts {arch.model_type!r} is not "
            "supported yet (its all-gather token dispatcher takes fixed shapes); set pp to 1"
        )
    if arch.moe is not None and arch.moe.expert_intermediate_size % tp:
        raise ValueError(
            f"moe_intermediate_size={arch.moe.expert_intermediate_size} is not divisible by "
            f"TrainerConfig.tp={tp}; choose a divisor of it"
        )
    if arch.intermediate_size % tp:
        raise ValueError(
            f"intermediate_size={arch.intermediate_size} is not divisible by "
            f"TrainerConfig.tp={tp}; choose a divisor of it"
        )
    first_stage_layers = stage_layers(arch.num_layers, pp, 0)[1]
    uneven = pp > 1 and arch.num_layers % pp != 0
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        layernorm_epsilon=arch.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions need CUDA kernels; the unfused paths compute the same function. The SwiGLU
        # one is torch.compile'd code (any device), taken with `TrainerConfig.compile`.
        bias_activation_fusion=fused_swiglu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        num_layers_in_first_pipeline_stage=first_stage_layers if uneven else None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # packed micro-batches differ in length (PP exchanges shapes); a mixture runs PP = 1
        variable_seq_lengths=arch.moe is None,
        **moe_config_fields(arch, params_dtype, moe_aux_loss_coeff),  # trainer.megatron_moe
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF checkpoint
    )


def layer_spec(arch: ModelSpec, use_te: bool = False):
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def _mark_tensor_parallel_shards(model: torch.nn.Module) -> None:
    """Set megatron's `tensor_model_parallel` / `partition_dim` attributes on sharded weights.

    megatron-core 0.16.1 sets them only inside its weight initializers, which
    `perform_initialization=False` skips (we load HF weights instead). Without them every
    sharded weight looks like a TP duplicate, and the gradient norm (and anything else that
    asks `param_is_not_tensor_parallel_duplicate`) silently counts only TP rank 0's shard."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def build_gpt_model(
    arch: ModelSpec,
    *,
    params_dtype: torch.dtype = torch.float32,
    vocab_multiple: int = 128,
    use_te: bool = False,
    compile: bool = False,
    moe_aux_loss_coeff: float = 0.0,
) -> tuple[GPTModel, ModelLayout]:
    """This rank's GPTModel (random weights until `bridge.load_hf_weights`) and its layout;
    with `compile` its norms and SwiGLUs run compiled (`trainer.compiled`).

    Requires megatron parallel state (`trainer.parallel.init_parallel`)."""
    cpu_compat.apply()
    packed_rope.install()
    if use_te and device().type != "cuda":
        raise ValueError("trainer.use_transformer_engine needs CUDA; set it to false on CPU")
    config = transformer_config(
        arch,
        params_dtype=params_dtype,
        fused_swiglu=compile,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
    )
    if arch.moe is not None:
        if use_te:
            raise ValueError(
                "trainer.use_transformer_engine is not supported for a mixture of experts yet; "
                "set it to false"
            )
        patch_megatron_moe()
    tp = config.tensor_model_parallel_size
    pp = config.pipeline_model_parallel_size
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    offset, count = stage_layers(arch.num_layers, pp, pp_rank)
    layout = ModelLayout(
        padded_vocab_size=padded_vocab_size(arch.vocab_size, tp, vocab_multiple),
        layer_offset=offset,
        num_local_layers=count,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, use_te)
        if arch.moe is None
        else moe_block_spec(config),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=layout.pre_process,
        post_process=layout.post_process,
        parallel_output=True,  # logits stay vocab-sharded; logprobs reduce across TP
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope.theta),
    )
    dev = device()
    if params_dtype != torch.float32:
        # megatron's torch-norm wrapper ignores params_dtype: its weights would stay float32.
        # In float64 that rounds the checkpoint's norm weights (a 1e-7 relative error in every
        # layer); in bf16 the trainer would train float32 norm weights the engine, which loads
        # bf16, never sees, and the norm would take torch's mixed-dtype composite path (no fused
        # kernel: its rounding differs from the fused one's on a GPU). Every parameter is in
        # params_dtype, as the engine's are.
        model.to(dtype=params_dtype)
    _mark_tensor_parallel_shards(model)
    if arch.moe is not None:
        allow_tensor_parallel_training(model)
    model.to(dev)
    if compile:
        compiled.compile_norms(model)
        compiled.mark_rotary(model.config)
        compiled.compile_swiglu()
    # HF's inverse frequencies replace megatron's (see module docstring). The rotary module's
    # forward is lru-cached per length; it has not run yet, so nothing stale is cached.
    # Megatron computes the angles and cos / sin in inv_freq's dtype: fp64 for a float64 model.
    model.rotary_pos_emb.inv_freq = arch.rope.inv_freq(
        arch.head_dim, torch.promote_types(params_dtype, torch.float32)
    ).to(dev)
    return model, layout
