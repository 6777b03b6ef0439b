"""One decoder implementation for the Llama / Qwen2 / Qwen3 family and their mixtures of experts
(Qwen2-MoE, Qwen3-MoE: a layer's MLP is then a `rollout.moe.SparseMoE`).

Parameter names are exactly the Hugging Face names (`model.layers.3.self_attn.q_proj.weight`),
so loading a checkpoint from disk and receiving a weight update from the trainer are the same
call (`rollout.weights.load_weights`). The forward pass works on a flat batch of tokens from
many sequences (no padding); attention reads and writes the paged KV pool through a backend.

Given a `TPGroup` the same modules hold one tensor-parallel rank's shard
(`rollout.parallel_layers`): this rank's attention and KV heads, its share of the MLP, its
vocabulary rows; the logits are gathered so every rank returns the full [R, vocab] rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model_spec import ModelSpec
from rollout.attention import AttentionMetadata, TorchAttention
from rollout.config import accum_dtype
from rollout.fp8_linear import Fp8Linear, check_shards, quantize_linears
from rollout.moe import SparseMoE
from rollout.parallel_layers import column, embedding, lm_head, row
from rollout.rope import RotaryEmbedding
from rollout.tp_group import TPGroup


def _share_storage(
    linears: list[nn.Module], column_major: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The linears' weights (and biases) concatenated along the outputs into one new tensor
    each, current values kept; each parameter's data becomes its rows of it. `column_major`:
    the fused weight [out, in] is stored transposed (see `CausalLM.column_major`). FP8 layers
    (`rollout.fp8_linear`) stay apart: (None, None)."""
    if not all(isinstance(linear, nn.Linear) for linear in linears):  # FP8: each on its own
        return None, None
    fused = []
    for attr in ("weight", "bias"):
        params = [getattr(linear, attr) for linear in linears]
        if params[0] is None:
            fused.append(None)
            continue
        if attr == "weight" and column_major and params[0].dim() == 2:
            # [out, in] with strides (1, out): the [in, out] tensor in memory
            whole = torch.cat([p.data.t() for p in params], dim=1).t()
        else:
            whole = torch.cat([p.data for p in params])
        offset = 0
        for p in params:
            p.data = whole[offset : offset + p.shape[0]]
            offset += p.shape[0]
        fused.append(whole)
    return fused[0], fused[1]


def _lay_out(linear: nn.Linear, column_major: bool) -> None:
    """The weight [out, in] stored transposed (`column_major`: a view [out, in] of an [in, out]
    tensor) or as is (row-major); values kept, the storage replaced only when the layout
    changes."""
    weight = linear.weight.data
    if isinstance(linear, nn.Linear) and weight.dim() == 2:  # not an FP8 layer's
        linear.weight.data = weight.t().contiguous().t() if column_major else weight.contiguous()


class LayerPieces(NamedTuple):
    attention_inputs: Callable  # (layer, x, positions, rotary) -> q, k, v
    # (layer, x, attention output) -> x after the layer; may write over x (`CausalLM.forward`
    # passes each layer's input, which nothing reads afterwards)
    attention_outputs: Callable
    logits: Callable  # (model, hidden) -> logits in accum_dtype, this rank's vocabulary rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 at least whatever the model dtype, as the HF reference does.
        dtype = x.dtype
        x = x.to(accum_dtype(dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelSpec, layer_idx: int, tp: TPGroup | None = None):
        super().__init__()
        k = tp.size if tp is not None else 1
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads // k  # this rank's heads (all of them without TP)
        self.num_kv_heads = cfg.num_kv_heads // k
        self.head_dim = d = cfg.head_dim
        self.q_proj = column(cfg.hidden_size, cfg.num_heads * d, cfg.qkv_bias, tp, unit=d)
        self.k_proj = column(cfg.hidden_size, cfg.num_kv_heads * d, cfg.qkv_bias, tp, unit=d)
        self.v_proj = column(cfg.hidden_size, cfg.num_kv_heads * d, cfg.qkv_bias, tp, unit=d)
        self.o_proj = row(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp, unit=d)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # q/k/v weights and biases in one tensor each (`CausalLM.fuse_projections`), or None.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: TorchAttention,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, positions, rotary)
        return self.output(attn.forward(self.layer_idx, q, k, v, meta))

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k, v [T, Hkv, D] of the tokens' (normed) hidden states, rotated."""
        num_tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_weight is None:
            q = self.q_proj(x).view(num_tokens, heads, self.head_dim)
            k = self.k_proj(x).view(num_tokens, kv_heads, self.head_dim)
            v = self.v_proj(x).view(num_tokens, kv_heads, self.head_dim)
        else:  # one matrix multiply; q, k, v are views of its output heads
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(num_tokens, -1, self.head_dim)
            if self.q_norm is None:  # q and k rotate together: one pass over their heads
                qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
                q, k = rotary.rotate(qk, positions).split([heads, kv_heads], dim=1)
                return q, k, v
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """The SwiGLU MLP (`intermediate_size` wide unless given: a mixture's experts are narrower)."""

    def __init__(self, cfg: ModelSpec, tp: TPGroup | None = None, intermediate_size: int = 0):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = column(cfg.hidden_size, width, cfg.mlp_bias, tp)
        self.up_proj = column(cfg.hidden_size, width, cfg.mlp_bias, tp)
        self.down_proj = row(width, cfg.hidden_size, cfg.mlp_bias, tp)
        # gate/up weights and biases in one tensor each (`fuse_projections`), or None.
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of `forward` before the row-parallel all-reduce (the whole output
        without TP); for an MLP without biases, whose shares the caller sums once for many."""
        if self.gate_up_weight is None:
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        if isinstance(self.down_proj, Fp8Linear):
            return self.down_proj.matmul(hidden)
        return F.linear(hidden, self.down_proj.weight)

    def fuse_projections(self, column_major: bool) -> None:
        """gate/up in one tensor, down_proj laid out (`CausalLM.fuse_projections`)."""
        self.gate_up_weight, self.gate_up_bias = _share_storage(
            [self.gate_proj, self.up_proj], column_major
        )
        _lay_out(self.down_proj, column_major)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelSpec, layer_idx: int, tp: TPGroup | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, tp)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_idx)
        self.mlp = SparseMoE(cfg, tp, MLP) if sparse else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, attn, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, attn, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    # `forward` in the two pieces around the paged attention (`CausalLM.forward` runs these):
    # everything but attention itself, pure tensor code that `torch.compile` can fuse
    # (rollout.compiled).
    def attention_inputs(self, x, positions, rotary):
        return self.self_attn.project(self.input_layernorm(x), positions, rotary)

    def attention_outputs(self, x, attn_out):
        x = x + self.self_attn.output(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelSpec, tp: TPGroup | None = None):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`model.*` + `lm_head`, as in HF's *ForCausalLM. With tied embeddings `lm_head.weight`
    *is* `model.embed_tokens.weight` (one Parameter, listed once under the embedding's name)."""

    def __init__(self, cfg: ModelSpec, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp)
        # the mixture-of-experts layers, in order (a plain tuple: not registered twice)
        self.sparse_blocks = tuple(
            layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)
        )
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_weights()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        # Linear weights stored transposed ([in, out] in memory, the parameters [out, in] views
        # of it) when set before `fuse_projections`; the values, names and shapes of the
        # parameters are unchanged. Off by default on every device: at the engine's shapes CPU GEMMs
        # measured no gain from it beyond noise, and it turns every weight update into a
        # transposing copy (`rollout.weights.copy_into`) where row-major weights take a plain one.
        self.column_major = False
        # The per-layer pieces and the logits head: these plain functions (the reference), or
        # their torch.compile'd versions (`rollout.compiled.compile_model`).
        self.pieces = LayerPieces(
            DecoderLayer.attention_inputs, DecoderLayer.attention_outputs, CausalLM._logits
        )

    @classmethod
    def build(
        cls,
        cfg: ModelSpec,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
        quantization: str | None = None,
    ) -> CausalLM:
        """An inference-mode model with real but uninitialised parameters (fill them with
        `rollout.weights.load_weights`). Built on the meta device, so nothing is initialised twice;
        the rotary tables are computed in `accum_dtype(dtype)` on the real device. With `tp`, this
        rank's shard only. `quantization="fp8"`: the decoder layers' linear weights are held in
        block-wise FP8 (`rollout.fp8_linear`), the rest in `dtype`."""
        with torch.device("meta"):
            model = cls(cfg, max_positions, tp)
        model = model.to(dtype=dtype)
        if quantization == "fp8":  # after the dtype cast, which would cast FP8 weights too
            quantize_linears(model)
            if tp is not None:
                check_shards(model, tp.size)
        model = model.to_empty(device=device)
        model.tie_weights()
        model.rotary = RotaryEmbedding(
            cfg.rope, cfg.head_dim, max_positions, accum_dtype(dtype)
        ).to(device)
        model.fuse_projections()
        return model.eval().requires_grad_(False)

    def fuse_projections(self) -> None:
        """Give each layer's q/k/v weights (and biases) one tensor, and gate/up theirs, the
        parameters becoming views of it: each group is then one matrix multiply over the
        tokens (one pass over them, wider outputs) instead of two or three. Loading copies into
        the parameters in place, so it writes the fused tensors. Call again whenever the
        parameters' storage is replaced (`Engine.release_memory` / `resume_memory`): the fused
        tensors would otherwise keep the old storage alive and stale. A mixture's experts are
        fused each on its own. It also lays out every other linear weight as `column_major`
        says (not a tied LM head: the embedding reads its rows)."""
        column_major = self.column_major
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.qkv_weight, attn.qkv_bias = _share_storage(
                [attn.q_proj, attn.k_proj, attn.v_proj], column_major
            )
            _lay_out(attn.o_proj, column_major)
            layer.mlp.fuse_projections(column_major)
        if not self.config.tie_word_embeddings:
            _lay_out(self.lm_head, column_major)

    def release_storage(self) -> int:
        """Free every parameter's storage (the device goes to the trainer); returns the bytes
        freed. `restore_storage` brings it back."""
        released = 0
        for p in self.parameters():
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.fuse_projections()  # the fused tensors must not keep the storage alive
        for module in self.modules():  # nor the dequantized copies of FP8 weights
            if isinstance(module, Fp8Linear):
                module.forget_dequantized()
        return released

    def restore_storage(self, shapes: dict[str, torch.Size]) -> None:
        """Re-create, uninitialised, the storage `release_storage` freed (`shapes`: each
        parameter's, by name); the next weight update fills it. Parameters that kept their
        storage (and then the fused tensors) keep their addresses."""
        recreated = False
        for name, p in self.named_parameters():
            if p.numel() == 0 and len(shapes[name]):
                p.data = torch.empty(shapes[name], dtype=p.dtype, device=p.device)
                recreated = True
        if recreated:
            self.fuse_projections()

    def tie_weights(self) -> None:
        """Re-establish tying; needed again after conversions that rebuild parameters."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: TorchAttention,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat batch, before the final norm."""
        x = self.model.embed_tokens(input_ids)
        inputs, outputs, _ = self.pieces
        for layer in self.model.layers:
            q, k, v = inputs(layer, x, positions, self.rotary)
            x = outputs(layer, x, attn.forward(layer.self_attn.layer_idx, q, k, v, meta))
        return x

    def routes(self) -> torch.Tensor | None:
        """The top-k expert ids [T, sparse layers, k] each token of the last forward was routed
        to; None for a dense model."""
        blocks = self.sparse_blocks
        return torch.stack([b.routes for b in blocks], dim=1) if blocks else None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 (float64 for a float64 model) for the selected rows only (the norm is
        per token, so selecting rows first gives the same values as HF computing every row). Under
        TP each rank computes its vocabulary rows and every rank gets the gathered full rows."""
        logits = self.pieces.logits(self, hidden)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(hidden))
        return logits.to(accum_dtype(logits.dtype))
